"""`--outer-lr auto` and `--outer-momentum auto` (strategies/outer_lr.py, issues 39 and 44): the outer
step from M, H and the run's outer steps, recorded as its numbers in the run's config and metrics
and said in one line at the start; runs saved before it resume with the settings they ran with."""

import json
import math
import re
from pathlib import Path

import mlx.nn as nn
import numpy as np
import pytest

from conftest import run_cli, tiny_config
from mlx_diloco import Trainer
from mlx_diloco.config import ConfigError
from mlx_diloco.exchange.comm import SimCommunicator
from mlx_diloco.strategies import DiLoCo, SPARTADiLoCo, make_strategy
from mlx_diloco.strategies.outer_lr import auto_outer, choose, with_auto_outer
from mlx_diloco.training.run import Run


def test_auto_becomes_numbers_for_every_strategy_with_an_outer_step_to_pick():
    for name in ("diloco", "sparta-diloco", "quorum"):
        strategy = make_strategy(name, {"sync_every": 50})
        assert (strategy.outer_lr, strategy.outer_momentum) == ("auto", "auto")
        picked, choice = with_auto_outer(strategy, 8, 1000)
        assert (picked.outer_lr, picked.outer_momentum) == auto_outer(8, 50, 1000) and picked.sync_every == 50
        assert choice.outer_steps == 20
    composite, _ = with_auto_outer(SPARTADiLoCo(sync_every=50), 4, 1000)
    assert (composite.diloco.outer_lr, composite.diloco.outer_momentum) == auto_outer(4, 50, 1000)  # the part that steps
    muloco, _ = with_auto_outer(make_strategy("muloco", {"sync_every": 50}), 4, 1000)
    assert muloco.outer_momentum == 0.6 and muloco.outer_lr == choose(4, 50, 1000, momentum=0.6).lr  # its authors' momentum
    given = DiLoCo(outer_lr=0.3, outer_momentum=0.9)
    assert with_auto_outer(given, 8, 1000) == (given, None)
    half, _ = with_auto_outer(DiLoCo(sync_every=50, outer_lr=0.3), 8, 1000)  # the momentum alone left to auto
    assert (half.outer_lr, half.outer_momentum) == (0.3, auto_outer(8, 50, 1000)[1])


def test_auto_counts_the_outer_steps_a_run_takes():
    assert choose(4, 10, 1000).outer_steps == 100
    assert choose(4, 10, 1000, warmup_steps=200).outer_steps == 80  # DDP warmup steps take no outer step
    assert choose(4, 5, 1650).measured_at == (4, 5) and choose(4, 50, 500).measured_at == (4, 30)
    assert choose(2, 40, 500).measured_at == (4, 30) and choose(1, 40, 500).measured_at == (1, 30)
    assert "outside the measured range" not in choose(4, 30, 1650).why()
    far = choose(16, 1000, 5000).why()
    assert "M=16 and H=1000" in far or ("M=16" in far and "H=1000" in far)
    assert "outside the measured range" in far


def test_auto_is_near_the_best_of_every_cell_the_grid_measured():
    """bench/results/outer-grid.json (bench/outer_grid.py: every run's eval loss at `tiny`, and at
    `small` for the check at another size; DP's and DiLoCo's over M, H, T, outer lr and momentum): in
    each measured cell auto's (lr, momentum) was run,
    and it is within 1.5% of the cell's best eval loss, where the old default 0.7 / 0.9 paid up to 5
    points more at M = 4 and 8 (momentum 0.9 was the worst momentum of every cell there)."""
    runs = json.loads((Path(__file__).parents[1] / "bench" / "results" / "outer-grid.json").read_text())
    dp, model = {}, r"(?:(\w+?)_)?"  # (a model other than tiny prefixes its runs: --stage size)
    for name, loss in runs.items():
        if m := re.fullmatch(model + r"dp_T(\d+)_lr[\d.]+", name):
            dp[m[1], int(m[2])] = min(dp.get((m[1], int(m[2])), math.inf), loss)
    cells = {}
    for name, loss in runs.items():
        if m := re.fullmatch(model + r"M(\d+)_H(\d+)_T(\d+)_mu([\d.]+)_olr([\d.]+)_lr[\d.]+", name):
            cells.setdefault((m[1], *map(int, m.groups()[1:4])), {})[(float(m[6]), float(m[5]))] = loss
    assert len(cells) >= 20 and any(size == "small" for size, *_ in cells)
    for (size, M, H, T), losses in cells.items():
        lr, mu = auto_outer(M, H, T)
        ran = next(loss for (olr, omu), loss in losses.items() if omu == mu and abs(olr - lr) < 0.01)
        assert ran / min(losses.values()) - 1 < 0.015, (size, M, H, T, lr, mu)
        assert ran / dp[size, T] - 1 < 0.12, (size, M, H, T)  # the grid's worst cell: M = 8, H = 30, 55 outer steps


def test_a_run_records_autos_number_in_its_config_and_metrics(tmp_path):
    config = tiny_config(workers=4, steps=4)  # H = 4
    Run(config, tmp_path / "r", SimCommunicator(4), log=lambda m: None).train()
    recorded = json.loads((tmp_path / "r" / "config.json").read_text())
    assert (recorded["outer_lr"], recorded["outer_momentum"]) == auto_outer(4, 4, 4)
    last = json.loads((tmp_path / "r" / "metrics.jsonl").read_text().splitlines()[-1])
    assert (last["strategy_options"]["outer_lr"], last["strategy_options"]["outer_momentum"]) == auto_outer(4, 4, 4)


def test_the_api_records_autos_number(tmp_path):
    x = np.random.default_rng(0).normal(size=(64, 8)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    loss = lambda model, x, y: nn.losses.cross_entropy(model(x), y, reduction="mean")  # noqa: E731
    said = []
    result = Trainer(nn.Linear(8, 2), loss, (x, y), batch_size=4, eval_sequences=8, log=said.append).fit(
        DiLoCo(sync_every=4), workers=2, steps=4, run_dir=tmp_path / "api", processes=1)
    recorded = json.loads((tmp_path / "api" / "config.json").read_text())
    assert (recorded["outer_lr"], recorded["outer_momentum"]) == auto_outer(2, 4, 4)
    assert result.metrics[-1]["strategy_options"]["outer_lr"] == auto_outer(2, 4, 4)[0]
    assert sum("by auto: M=2, H=4, 1 outer steps" in line for line in said) == 1


def saved_without(run_dir, keys):
    """Rewrite a run's checkpoints as the versions before auto wrote them: `keys`, left to their
    defaults (then outer lr 0.7, momentum 0.9), not in the recorded config."""
    for meta in run_dir.glob("ckpt-*.json"):
        saved = json.loads(meta.read_text())
        for key in keys:
            del saved["config"][key]
        meta.write_text(json.dumps(saved))


@pytest.mark.parametrize("old", [("outer_lr", "outer_momentum"), ("outer_momentum",), ()],
                         ids=["saved-before-auto", "saved-before-momentum-auto", "saved-with-both"])
def test_a_run_saved_with_0_7_and_0_9_resumes_with_them(tmp_path, old):
    run_dir = tmp_path / "r"
    args = ["sim", "--model", "tiny", "--seq-len", "16", "--batch-size", "4", "--workers", "4", "--steps", "8",
            "--sync-every", "4", "--run-dir", run_dir, "--sample-tokens", "0"]
    first = Run(tiny_config(workers=4, steps=8, outer_lr=0.7, outer_momentum=0.9), run_dir, SimCommunicator(4),
                log=lambda m: None)
    first.train(stop_after=4)
    saved_without(run_dir, old)
    assert auto_outer(4, 4, 8) != (0.7, 0.9)  # else the test could not tell them apart
    resumed = run_cli("sim", "--resume", "--run-dir", run_dir, "--sample-tokens", "0")
    assert resumed.returncode == 0, resumed.stderr
    recorded = json.loads((run_dir / "config.json").read_text())
    assert (recorded["outer_lr"], recorded["outer_momentum"]) == (0.7, 0.9)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 8 and rows[-1]["strategy_options"]["outer_momentum"] == 0.9
    fresh = run_cli(*args[:-4], "--run-dir", tmp_path / "new", "--sample-tokens", "0")  # a new run: auto
    assert fresh.returncode == 0, fresh.stderr
    recorded = json.loads((tmp_path / "new" / "config.json").read_text())
    assert (recorded["outer_lr"], recorded["outer_momentum"]) == auto_outer(4, 4, 8)
    assert "by auto: M=4, H=4, 2 outer steps" in fresh.stdout + fresh.stderr


def test_auto_is_refused_with_outer_adam_in_one_line():
    with pytest.raises(ConfigError, match="outer-lr auto is the rule for nesterov and sgd; with outer-optimizer adam "
                                          "pass a number"):
        DiLoCo(outer_optimizer="adam")
    adam, _ = with_auto_outer(DiLoCo(outer_optimizer="adam", outer_lr=0.05), 4, 100)
    assert (adam.outer_lr, adam.outer_momentum) == (0.05, 0.9)  # momentum auto: Adam's beta1, as before


def test_flags_take_auto_or_a_number_and_help_says_what_auto_gives():
    help_text = " ".join(run_cli("sim", "--help").stdout.split()).replace("sparta- diloco", "sparta-diloco")  # wrapped
    assert "or auto: from M, H and the run's outer steps" in help_text
    assert "diloco, muloco, sparta-diloco, quorum: default auto" in help_text
    bad = run_cli("sim", "--outer-lr", "fast")
    assert bad.returncode == 2 and "'fast' is neither a number nor auto" in bad.stderr
    refused = run_cli("sim", "--strategy", "noloco", "--outer-lr", "auto", "--steps", "1")
    assert refused.returncode == 2 and 'outer-lr must be a number, not "auto"' in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
