"""The gym: problems and scorecards, sweeps that resume, and workers of different speeds."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from conftest import addition_task, run_cli
from mlx_diloco.config import ConfigError, TrainConfig
from mlx_diloco.exchange.comm import SimCommunicator
from mlx_diloco.gym import scorecard
from mlx_diloco.gym.problems import PROBLEMS
from mlx_diloco.schedules.speeds import Speeds
from mlx_diloco.training.metrics import MetricsLog
from mlx_diloco.training.resolve import resolve
from mlx_diloco.training.run import Run

TINY = dict(model="tiny", seq_len=16, batch_size=4, eval_sequences=8, warmup=2)
TINY_FLAGS = ["--model", "tiny", "--seq-len", "16", "--batch-size", "4", "--eval-sequences", "8", "--warmup", "2"]


def test_every_problem_is_a_valid_config(tmp_path):
    task = addition_task(tmp_path)  # the post-training problems' paths, without training their SFT start
    for p in PROBLEMS.values():
        for size in ("cpu", "large"):
            paths = {"model": str(task / "model"), "data": str(task / p.config["objective"])} if p.task else {}
            resolve(TrainConfig.from_dict({**p.settings(size), **paths}))
            # any strategy runs it: the problem's options of others (its H) are left out
            resolve(TrainConfig.from_dict({**p.settings(size, "ddp"), **paths, "strategy": "ddp"}))
    out = run_cli("gym", "list")
    assert out.returncode == 0 and all(name in out.stdout for name in PROBLEMS)
    # addition-grpo's DiLoCo recipe (H 6, int4 with error feedback, its outer step) is DiLoCo's alone:
    # DDP sends fp16 every step, as data-parallel training does.
    grpo = PROBLEMS["addition-grpo"]
    assert {k: grpo.settings(strategy="diloco")[k] for k in ("sync_every", "compress", "error_feedback")} == \
        {"sync_every": 6, "compress": "int4", "error_feedback": True}
    assert not {"sync_every", "compress", "error_feedback", "outer_lr"} & set(grpo.settings(strategy="ddp"))


def test_gym_run_scores_the_run_and_compare_tables_it(tmp_path):
    out = run_cli("gym", "run", "shakespeare-home", *TINY_FLAGS, "--steps", "12", "--sync-every", "4",
                  "--eval-every", "4", "--run-dir", tmp_path / "a", "--processes", "1")
    assert out.returncode == 0, out.stderr
    card = json.loads((tmp_path / "a" / "scorecard.json").read_text())
    rows = MetricsLog.read(tmp_path / "a")
    assert card["problem"] == "shakespeare-home" and card["link"].startswith("home internet")
    assert card["final_eval_loss"] == rows[-1]["eval_loss"] and card["steps"] == 12
    # 4 workers, 12 steps of 4 x 16 tokens; the problem's fixed step time makes the modelled time
    assert card["tokens"] == 4 * 12 * 4 * 16
    assert card["modelled_s"] == pytest.approx(12 * PROBLEMS["shakespeare-home"].config["step_time"] + rows[-1]["comm_s"])
    assert card["bytes_sent_per_worker"] > 0 and card["peak_exchange_bytes"] <= card["bytes_sent_per_worker"]
    assert card["worker_spread"] > 0  # four workers on four shards drift apart between syncs
    # time to target: the first evaluation at or below it
    target = rows[2]["eval_loss"] + 1e-6
    again = scorecard.scorecard(tmp_path / "a", target_loss=target)
    first = next(r for r in rows if r["eval_loss"] <= target)
    assert again["steps_to_target"] == first["step"] and again["modelled_s_to_target"] == first["modelled_time_s"]
    assert scorecard.scorecard(tmp_path / "a", target_loss=0.1)["steps_to_target"] is None

    assert run_cli("gym", "run", "shakespeare-home", *TINY_FLAGS, "--steps", "12", "--strategy", "ddp",
                   "--run-dir", tmp_path / "b", "--processes", "1").returncode == 0
    png = tmp_path / "cards.png"
    out = run_cli("gym", "compare", tmp_path / "a" / "scorecard.json", tmp_path / "b", "--out", png)
    assert out.returncode == 0, out.stderr
    table = [line for line in out.stdout.splitlines() if line.startswith("| ")]
    assert len(table) == 3 and "diloco H=4" in table[1] and "ddp" in table[2]
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_sweep_runs_every_point_and_resumes(tmp_path):
    args = ["sweep", "--grid", "workers=1,2", "--grid", "sync_every=3,6", "--out", tmp_path / "s",
            *TINY_FLAGS, "--steps", "6", "--processes", "1"]
    out = run_cli(*args)
    assert out.returncode == 0, out.stderr
    names = ["workers=1,sync_every=3", "workers=1,sync_every=6", "workers=2,sync_every=3", "workers=2,sync_every=6"]
    table = (tmp_path / "s" / "sweep.md").read_text().splitlines()
    assert len(table) == 2 + len(names) and (tmp_path / "s" / "sweep.png").stat().st_size > 0
    printed = [line.split(" | ")[0] for line in out.stdout.splitlines() if line.startswith("| ")][1:]
    assert len(set(printed)) == len(names)  # each point its own name (workers=1 and 2 read alike before)
    for name in names:
        card = json.loads((tmp_path / "s" / name / "scorecard.json").read_text())
        assert card["point"]["workers"] == int(name[8]) and card["steps"] == 6
    # A point cut off after a checkpoint (here: its summary lost) resumes; the others are kept as they are.
    kept = (tmp_path / "s" / names[0] / "metrics.jsonl").stat().st_mtime_ns
    (tmp_path / "s" / names[3] / "summary.json").unlink()
    out = run_cli(*args)
    assert out.returncode == 0, out.stderr
    assert "done before, kept" in out.stderr and f"{names[3]}: resuming" in out.stderr
    assert (tmp_path / "s" / names[0] / "metrics.jsonl").stat().st_mtime_ns == kept
    assert (tmp_path / "s" / names[3] / "summary.json").exists()
    bad = run_cli("sweep", "--grid", "sync_evry=3", "--out", tmp_path / "t", *TINY_FLAGS)
    assert bad.returncode == 2 and "did you mean 'sync_every'" in bad.stderr and not (tmp_path / "t").exists()


def test_a_sweep_over_strategies_keeps_each_points_own_options(tmp_path):
    # H given for the sweep (or by a problem, as the post-training problems' H = 25) and a ddp point:
    # ddp has no H, and its point runs without it rather than the sweep refusing every point
    out = run_cli("sweep", "--grid", "strategy=diloco,ddp", "--sync-every", "3", "--out", tmp_path / "s",
                  *TINY_FLAGS, "--steps", "3", "--workers", "2", "--processes", "1")
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads((tmp_path / "s" / "strategy=ddp" / "config.json").read_text())["strategy"] == "ddp"
    assert json.loads((tmp_path / "s" / "strategy=diloco" / "config.json").read_text())["sync_every"] == 3


def test_speeds_pace_workers():
    config = TrainConfig.from_dict(dict(workers=3, worker_speeds="1,0.5,0.25", speed_policy="time"))
    s = Speeds.of(config)
    assert s.steps_taken(8) == [8, 4, 2]
    assert [s.active(t) for t in (1, 2, 4)] == [[True, False, False], [True, True, False], [True, True, True]]
    assert s.sync_weights(8) == pytest.approx([3 * 8 / 14, 3 * 4 / 14, 3 * 2 / 14])
    assert s.tick_seconds(0.1) == pytest.approx(0.1) and s.idle_fraction() == [0, 0, 0]
    fixed = Speeds.of(TrainConfig.from_dict(dict(workers=3, worker_speeds="1,0.5,0.25")))
    assert fixed.steps_taken(8) == [8, 8, 8] and fixed.sync_weights(8) == [1, 1, 1]
    assert fixed.tick_seconds(0.1) == pytest.approx(0.4) and fixed.idle_fraction() == pytest.approx([0.75, 0.5, 0])
    for speeds, message in [("1,1", "2 speeds for 3 workers"), ("1,0,1", "must all be > 0"), ("1,a,1", "numbers")]:
        with pytest.raises(ConfigError, match=message):
            TrainConfig.from_dict(dict(workers=3, worker_speeds=speeds))


def test_time_paced_workers_take_the_steps_that_fit(tmp_path):
    """Speeds 1 and 0.5, time policy: the slow worker steps at every other tick (its parameters
    and moments stay as they were at the others), its pseudo-gradient counts half as much, and
    the tokens and modelled time say so."""
    config = TrainConfig.from_dict(dict(TINY, workers=2, steps=8, sync_every=4, worker_speeds="1,0.5",
                                        speed_policy="time", step_time=0.1, warmup=0))
    run = Run(config, tmp_path / "t", SimCommunicator(2), log=lambda m: None)
    assert run.pacing.inputs_at(4).sync_weights == pytest.approx([4 / 3, 2 / 3])
    before = {k: np.array(v) for k, v in tree_flatten(run.workers.params)}
    run.train(stop_after=1)  # tick 1: only the fast worker steps
    after = dict(tree_flatten(run.workers.params))
    assert all(np.array_equal(np.array(after[k][1]), before[k][1]) for k in before)
    assert any(not np.array_equal(np.array(after[k][0]), before[k][0]) for k in before)
    moments = [v for k, v in tree_flatten(run.workers.optimizer.state) if k.endswith(".m")]
    assert all(float(mx.abs(m[1]).max()) == 0 for m in moments) and any(float(mx.abs(m[0]).max()) > 0 for m in moments)
    summary = run.train()
    assert summary["tokens"] == (8 + 4) * 4 * 16
    rows = MetricsLog.read(tmp_path / "t")
    assert rows[-1]["compute_s"] == pytest.approx(8 * 0.1) and rows[-1]["idle_fraction"] == 0

    fixed = Run(TrainConfig.from_dict(dict(TINY, workers=2, steps=8, sync_every=4, worker_speeds="1,0.5",
                                           step_time=0.1)), tmp_path / "f", SimCommunicator(2), log=lambda m: None)
    fixed.train()
    rows = MetricsLog.read(tmp_path / "f")
    assert rows[-1]["tokens"] == 2 * 8 * 4 * 16 and rows[-1]["compute_s"] == pytest.approx(8 * 0.2)
    assert rows[-1]["idle_fraction"] == pytest.approx(0.25) and rows[-1]["utilisation"] < 0.76


def test_measured_speeds_apply_after_the_round_that_measured_them():
    """Every worker stepped through the first round (H = 10): the slow one's steps and weight follow
    its speed only from there."""
    speeds = Speeds((1, 0.5), "time", start=10)
    assert speeds.steps_taken(10) == [10, 10] and speeds.steps_taken(20) == [20, 15]
    assert speeds.active(11) == [True, False] and speeds.active(12) == [True, True]
    assert speeds.sync_weights(10) == pytest.approx([4 / 3, 2 / 3])


def test_a_cluster_measures_its_workers_speeds(tmp_path):
    """Time-paced without given speeds, as `launch` runs it: each process measures its steps over
    the first round and the workers agree on the speeds over MLX's ring (here two processes)."""
    out = run_cli("sim", *TINY_FLAGS, "--workers", "2", "--processes", "2", "--steps", "8", "--sync-every", "4",
                  "--speed-policy", "time", "--run-dir", tmp_path / "m", "--sample-tokens", "0")
    assert out.returncode == 0, out.stderr
    assert "measured worker speeds" in out.stderr
    rows = MetricsLog.read(tmp_path / "m")
    speeds = rows[-1]["worker_speeds"]
    assert rows[0]["worker_speeds"] is None and len(speeds) == 2 and max(speeds) == 1 and min(speeds) >= 0.25


def test_time_policy_needs_a_strategy_that_syncs_periodically(tmp_path):
    for options, message in [(dict(strategy="ddp"), "needs a strategy that exchanges only at its syncs"),
                             (dict(sync_every=2, worker_speeds="1,0.25"), "takes no step in a round")]:
        with pytest.raises(ConfigError, match=message):  # found in the config, before a run starts
            resolve(TrainConfig.from_dict({**TINY, "workers": 2, "steps": 4, "worker_speeds": "1,0.5",
                                           "speed_policy": "time", **options}))
        config = TrainConfig.from_dict({**TINY, "workers": 2, "steps": 4, "worker_speeds": "1,0.5", **options})
        config.speed_policy = "time"  # set past the config's checks: the run checks again
        with pytest.raises(ConfigError, match=message):
            Run(config, tmp_path / "r", SimCommunicator(2), log=lambda m: None)


def test_a_time_paced_run_resumes_exactly(tmp_path):
    config = TrainConfig.from_dict(dict(TINY, workers=2, steps=8, sync_every=4, worker_speeds="1,0.5",
                                        speed_policy="time"))
    whole = Run(config, tmp_path / "whole", SimCommunicator(2), log=lambda m: None).train()
    Run(config, tmp_path / "cut", SimCommunicator(2), log=lambda m: None).train(stop_after=4)
    resumed = Run(None, tmp_path / "cut", SimCommunicator(2), resume=True, log=lambda m: None).train()
    assert resumed["final_eval_loss"] == whole["final_eval_loss"] and resumed["tokens"] == whole["tokens"]


def test_plot_axes_and_labels_say_what_the_runs_are(tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from mlx_diloco.tools.plot import label, run_label, spread_axis, value_axis
    fig, (a, b, c, d) = plt.subplots(1, 4)
    value_axis(a, [10, 20, 30])  # H: a tick at each value (a log2 axis ticked only "2^4" before)
    assert a.get_xscale() == "linear" and [t.get_text() for t in a.get_xticklabels()] == ["10", "20", "30"]
    value_axis(b, [1, 2, 4, 8])
    assert b.get_xscale() == "log" and [t.get_text() for t in b.get_xticklabels()] == ["1", "2", "4", "8"]
    c.plot([0, 0.03, 1.5], [3, 2, 1])
    c.set_xlabel("modelled time (s)")
    spread_axis(c, [0, 0.03, 1.5])  # log above 0.01, and t = 0 on the axis (a log axis dropped it)
    assert c.get_xscale() == "symlog" and c.get_xlim()[0] <= 0 and "log scale above 0.01" in c.get_xlabel()
    spread_axis(d, [0, 0.2, 0.5])  # less than a decade: linear
    assert d.get_xscale() == "linear"
    plt.close(fig)
    options = {"sync_every": 10, "fragments": 2, "overlap_steps": 2, "compress": "int4"}
    assert label("diloco", options, {}) == "diloco H=10 P=2 tau=2 int4"
    assert label("diloco", {"sync_every": 10}, {"membership": "0:4,30:3"}) == "diloco H=10 members 0:4,30:3"
    rows = [{"strategy": "diloco", "workers": 2, "strategy_options": options}]  # a streaming run read as plain DiLoCo
    assert run_label(rows, tmp_path / "run") == "diloco x2 H=10 P=2 tau=2 int4 (run)"
