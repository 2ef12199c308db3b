"""Quorum rounds (strategies/quorum.py, after Decoupled DiLoCo): the outer step waits for K of M
reports, a late worker counts at a later outer step by its tokens and staleness;
checked against a numpy reference of that definition, against DiLoCo where they coincide, and in
runs."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from conftest import assert_same_arrays, resumed_run, run_cli, tiny_config
from mlx_diloco.config import ConfigError
from mlx_diloco.exchange.comm import NonFiniteValues, SimCommunicator
from mlx_diloco.tools.export import load_trained_model
from mlx_diloco.schedules.speeds import Speeds
from mlx_diloco.strategies.base import TickInputs
from mlx_diloco.strategies.quorum import Quorum
from mlx_diloco.training.run import Run
from test_zoo import ring

QUIET = dict(log=lambda m: None)


def reference(init, updates, speeds, H, K, grace, T, lr=0.7, momentum=0.9, exponent=1.0):
    """The definition in float64: workers step (x -= update) at the ticks their speed reaches; a
    worker reports after H steps in its round; at the first tick with K reports and `grace` ticks
    since the K-th (or M reports), the reported workers' (global - local) enter a mean weighted by
    tokens / (1 + outer steps missed) ** exponent, Nesterov steps the global model, and they restart
    from it. The last tick applies everyone (a plain mean when nobody reported).
    Returns the global model after each tick and the ticks of the outer steps."""
    M = len(speeds)
    taken = Speeds(tuple(speeds), "time").steps_taken
    glob, v = init.astype(np.float64), np.zeros(init.shape)
    local = [glob.copy() for _ in range(M)]
    base, born, reported = [0] * M, [0] * M, [None] * M
    outer, quorum_tick, globals_, outer_ticks = 0, None, [], []
    for t in range(1, T + 1):
        now, before = taken(t), taken(t - 1)
        for w in range(M):
            if now[w] > before[w]:
                local[w] = local[w] - updates[t][w]
            if reported[w] is None and now[w] - base[w] >= H:
                reported[w] = t
        rep = [w for w in range(M) if reported[w] is not None]
        if quorum_tick is None and len(rep) >= K:
            quorum_tick = t
        if t == T:
            applied = list(range(M))
        elif len(rep) == M or (quorum_tick is not None and t - quorum_tick >= grace):
            applied = rep
        else:
            globals_.append(glob.copy())
            continue
        a = {w: (now[w] - base[w]) / (1 + outer - born[w]) ** exponent for w in applied}
        delta = sum(a[w] * (glob - local[w]) for w in applied) / sum(a.values())
        if t == T and not rep:
            glob = glob - delta
        else:
            v = momentum * v + delta
            glob = glob - lr * (delta + momentum * v)
        outer += 1
        for w in applied:
            local[w], base[w], born[w], reported[w] = glob.copy(), now[w], outer, None
        quorum_tick = None
        globals_.append(glob.copy())
        outer_ticks.append(t)
    return globals_, outer_ticks


def drive(init, updates, speeds, H, K, grace, T, nan_at=None, until=None):
    """The strategy through SimCommunicator on a one-array "model", each worker stepping as above
    (`until`: stop after that tick of a run of T)."""
    M = len(speeds)
    strategy = Quorum(sync_every=H, quorum=K, grace_steps=grace, outer_lr=0.7, outer_momentum=0.9, compress="fp32").bind(SimCommunicator(M), T)
    strategy.setup({"w": mx.array(init)})
    taken = Speeds(tuple(speeds), "time").steps_taken
    params, globals_ = {"w": mx.array(np.stack([init] * M))}, []
    for t in range(1, (until or T) + 1):
        step = np.array([updates[t][w] if a > b else np.zeros_like(init) for w, (a, b) in
                         enumerate(zip(taken(t), taken(t - 1)))], np.float32)
        if nan_at and nan_at[0] == t:
            step[nan_at[1], 0] = np.nan
        params = strategy.after_step({"w": params["w"] - mx.array(step)}, t, TickInputs(steps_taken=taken(t)))
        globals_.append(np.array(strategy.global_params(params)["w"]))
    return globals_, strategy, params


def problem(M, scale, T, seed=0, L=64):
    """Initial values and heavy-tailed updates (Student t, 1.5 degrees of freedom) at `scale`."""
    rng = np.random.default_rng(seed)
    init = (rng.standard_normal(L) * scale).astype(np.float32)
    updates = {t: (rng.standard_t(1.5, (M, L)) * 0.01 * scale).astype(np.float32) for t in range(1, T + 1)}
    return init, updates


CASES = {  # speeds, H, K, grace, T, and the ticks of the outer steps the reference takes
    # the slow worker reports at 8, with the fast ones' second round: stale by one outer step
    "straggler": (lambda M: [1.0] * (M - 1) + [0.5], 4, lambda M: M - 1, 0, 10, lambda M: [4, 8, 10]),
    # the 0.8 worker reports at 5, inside the grace window, and all M have: the fast workers count
    # 5 tokens to its 4
    "grace": (lambda M: [1.0] * (M - 1) + [0.8], 4, lambda M: M - 1, 2, 12, lambda M: [5, 10, 12]),
    # two stragglers and K = M - 2: the 0.5 worker is applied at 10 (stale by one), the 0.3 one at 15
    # (M = 3, K = 1: the 0.5 worker's own report at 8 is a quorum, applied at 9)
    "two slow": (lambda M: [1.0] * (M - 2) + [0.5, 0.3], 4, lambda M: M - 2, 1, 16,
                 lambda M: [5, 9, 14, 16] if M == 3 else [5, 10, 15, 16]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("M", [2, 3, 5, 8])
@pytest.mark.parametrize("scale", [1e-8, 1.0, 1e4])
def test_strategy_matches_the_reference(case, M, scale):
    speeds, H, K, grace, T, ticks = CASES[case]
    if K(M) < 1:
        pytest.skip("K = M - 2 needs M >= 3")
    init, updates = problem(M, scale, T)
    want, outer_ticks = reference(init, updates, speeds(M), H, K(M), grace, T)
    assert outer_ticks == ticks(M)
    got, strategy, _ = drive(init, updates, speeds(M), H, K(M), grace, T)
    for t, (g, w) in enumerate(zip(got, want), start=1):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4 * scale, err_msg=f"tick {t}")
    assert strategy.rounds.reported == [-1] * M  # the run ended with every report applied


def test_a_worker_not_applied_trains_on():
    """After the first outer step (tick 4) the straggler's values are its own (the initial model
    less its two steps); the fast workers hold the new global model."""
    init, updates = problem(3, 1.0, 10)
    globals_, strategy, params = drive(init, updates, [1.0, 1.0, 0.5], 4, 2, 0, T=10, until=4)
    assert strategy.rounds.version == [1, 1, 0]
    local = np.array(params["w"])
    np.testing.assert_allclose(local[2], init - updates[2][2] - updates[4][2], rtol=1e-6)
    np.testing.assert_array_equal(local[:2], np.stack([globals_[-1]] * 2))


@pytest.mark.parametrize("worker", [0, 2])
def test_a_nan_from_one_worker_stops_the_outer_step_naming_it(worker):
    """Worker 0 is applied at tick 4, worker 2 (the straggler) is not: its NaN is caught all the same."""
    init, updates = problem(3, 1.0, 10)
    with pytest.raises(NonFiniteValues, match=f"worker {worker} sent non-finite values"):
        drive(init, updates, [1.0, 1.0, 0.5], 4, 2, 0, T=10, nan_at=(3, worker))


def global_of(run):
    return {k: np.array(v) for k, v in tree_flatten(run.strategy.global_params(run.workers.params))}


@pytest.mark.parametrize("options", [dict(quorum=3), dict(quorum=0),
                                     dict(quorum=3, worker_speeds="1,1,1", speed_policy="time")],
                         ids=["K=M", "K=M-1", "equal speeds, time"])
def test_equal_speeds_is_diloco(tmp_path, options):
    """Everyone reports at once: quorum rounds are DiLoCo's rounds, to the bit (10 steps: a short last round)."""
    extra = {k: v for k, v in options.items() if k != "quorum"}
    runs = [Run(tiny_config(strategy=s, workers=3, steps=10, **o), tmp_path / s, SimCommunicator(3), **QUIET)
            for s, o in (("quorum", options), ("diloco", extra))]
    for run in runs:
        run.train()
    a, b = (global_of(run) for run in runs)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert runs[0].ledger.bytes_sent == runs[1].ledger.bytes_sent


SLOW_MAC = dict(workers=4, worker_speeds="1,1,1,0.25", speed_policy="time", step_time=0.05, eval_every=4)


def test_slow_mac_run_trains_and_counts_one_all_reduce_per_outer_step(tmp_path):
    config = tiny_config(strategy="quorum", steps=24, grace_steps=1, **SLOW_MAC)
    run = Run(config, tmp_path / "q", SimCommunicator(4), **QUIET)
    run.train()
    init, updates = problem(4, 1.0, 24)
    outer_ticks = reference(init, updates, [1, 1, 1, 0.25], 4, 3, 1, 24)[1]
    assert outer_ticks == [5, 10, 15, 19, 24]  # the slow Mac reports at 16; at 19 all four have
    assert run.ledger.bytes_sent == len(outer_ticks) * ring(4, run.n_params * 2)  # fp16 pseudo-gradients
    rows = [json.loads(l) for l in (tmp_path / "q" / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    assert last["eval_loss"] < rows[0]["eval_loss"] - 0.05
    assert [r["outer_step"] for r in rows] == [0, 0, 1, 2, 3, 4, 5]  # evaluations every 4 ticks
    assert last["tokens_per_shard"][3] * 4 == last["tokens_per_shard"][0]  # it took a quarter of the steps
    assert last["compute_s"] == pytest.approx(24 * 0.05)  # a tick: the fast workers' step; nobody waits
    assert last["modelled_time_s"] == pytest.approx(last["compute_s"] + last["comm_s"])
    assert last["utilisation"] == pytest.approx(last["compute_s"] / last["modelled_time_s"])
    # DiLoCo's fixed pace makes the same tokens' worth of fast-worker steps wait for the slow Mac: 4x the compute time
    fixed = Run(tiny_config(strategy="diloco", steps=24, **{**SLOW_MAC, "speed_policy": "fixed"}),
                tmp_path / "d", SimCommunicator(4), **QUIET)
    fixed.train()
    assert fixed.compute_s == pytest.approx(4 * last["compute_s"])


def test_resume_continues_exactly(tmp_path):
    """Stopped at 10, the checkpoint at 8 holds the straggler's round (begun before the first outer step)."""
    config = tiny_config(strategy="quorum", steps=16, grace_steps=1, **SLOW_MAC)
    straight = Run(config, tmp_path / "straight", SimCommunicator(4), **QUIET)
    straight.train()
    resumed = resumed_run(config, tmp_path / "split", stop_after=10)
    assert resumed.steps_done == 8 and resumed.strategy.rounds.version == [1, 1, 1, 0]
    resumed.train()
    assert_same_arrays(global_of(straight), global_of(resumed))


def test_two_processes_over_the_ring_train_like_one(tmp_path):
    """`sim --processes 2`: workers 0, 1 in one process, 2 and the slow Mac 3 in the other, joined by
    MLX's ring; the slow Mac sends zeros at the outer steps it is not part of (5, 10, 15), and its
    pseudo-gradient, three outer steps stale, at the last (16). (One process stepping no worker at a tick would count
    its inner optimizer's steps apart from the simulator's: here each process always steps one.)"""
    flags = dict(model="tiny", seq_len=16, batch_size=4, steps=16, eval_sequences=8, warmup=2, sample_tokens=0,
                 compress="fp32", strategy="quorum", sync_every=4, grace_steps=1, workers=4,
                 worker_speeds="1,1,1,0.25", speed_policy="time")
    out = run_cli("sim", *[a for k, v in flags.items() for a in (f"--{k.replace('_', '-')}", v)],
                  "--processes", "2", "--run-dir", tmp_path / "k2")
    assert out.returncode == 0, out.stderr[-2000:]
    one = Run(tiny_config(**{k: v for k, v in flags.items() if k != "sample_tokens"}), tmp_path / "k1",
              SimCommunicator(4), **QUIET)
    one.train()
    got = dict(tree_flatten(load_trained_model(tmp_path / "k2")[0].trainable_parameters()))
    for k, v in tree_flatten(one.global_params()):
        np.testing.assert_allclose(np.array(got[k]), np.array(v), rtol=1e-4, atol=1e-6, err_msg=k)


def test_bad_options_are_one_line():
    with pytest.raises(ConfigError, match="quorum \\(K\\) is 5 but the job has 4 workers"):
        Quorum(quorum=5).bind(SimCommunicator(4), 10)
    with pytest.raises(ConfigError, match="grace-steps must be >= 0"):
        Quorum(grace_steps=-2)
    with pytest.raises(ConfigError, match="outer-optimizer must be one of"):
        Quorum(outer_optimizer="lion")
