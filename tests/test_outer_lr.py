"""`--outer-lr auto` (strategies/outer_lr.py, issue 39): the outer lr from M and H, recorded as its
number in the run's config and metrics; runs saved before it resume with the outer lr they ran with."""

import json

import mlx.nn as nn
import numpy as np
import pytest

from conftest import run_cli, tiny_config
from mlx_diloco import Trainer
from mlx_diloco.config import ConfigError
from mlx_diloco.exchange.comm import SimCommunicator
from mlx_diloco.strategies import DiLoCo, SPARTADiLoCo, make_strategy
from mlx_diloco.strategies.outer_lr import BEST_AT_H30, MEASURED_H, SWEPT, auto_outer_lr, with_outer_lr
from mlx_diloco.training.run import Run


def test_auto_is_the_measured_best_at_h30_and_rises_with_m_and_h():
    for M, best in BEST_AT_H30.items():
        assert auto_outer_lr(M, MEASURED_H) == best
    for H in (10, 30, 50, 100, 500):
        by_m = [auto_outer_lr(M, H) for M in (1, 2, 3, 4, 6, 8, 16)]
        assert by_m == sorted(by_m) and SWEPT[0] <= min(by_m) and max(by_m) <= SWEPT[1]
    for M in (1, 4, 8):
        by_h = [auto_outer_lr(M, H) for H in (5, 30, 50, 100)]
        assert by_h == sorted(by_h)


def test_auto_becomes_a_number_for_every_strategy_with_an_outer_lr_to_pick():
    for strategy in (DiLoCo(sync_every=50), SPARTADiLoCo(sync_every=50), make_strategy("quorum", {"sync_every": 50}),
                     make_strategy("muloco", {"sync_every": 50})):
        assert strategy.outer_lr == "auto"
        picked = with_outer_lr(strategy, 8)
        assert picked.outer_lr == auto_outer_lr(8, 50) and picked.sync_every == 50
    composite = with_outer_lr(SPARTADiLoCo(sync_every=50), 4)
    assert composite.diloco.outer_lr == auto_outer_lr(4, 50)  # the part that steps
    given = DiLoCo(outer_lr=0.3)
    assert with_outer_lr(given, 8) is given


def test_a_run_records_autos_number_in_its_config_and_metrics(tmp_path):
    config = tiny_config(workers=4, steps=4)  # H = 4
    Run(config, tmp_path / "r", SimCommunicator(4), log=lambda m: None).train()
    recorded = json.loads((tmp_path / "r" / "config.json").read_text())
    assert recorded["outer_lr"] == auto_outer_lr(4, 4)
    last = json.loads((tmp_path / "r" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["strategy_options"]["outer_lr"] == auto_outer_lr(4, 4)


def test_the_api_records_autos_number(tmp_path):
    x = np.random.default_rng(0).normal(size=(64, 8)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    loss = lambda model, x, y: nn.losses.cross_entropy(model(x), y, reduction="mean")  # noqa: E731
    result = Trainer(nn.Linear(8, 2), loss, (x, y), batch_size=4, eval_batches=2, log=lambda m: None).fit(
        DiLoCo(sync_every=4), workers=2, steps=4, run_dir=tmp_path / "api", processes=1)
    assert json.loads((tmp_path / "api" / "config.json").read_text())["outer_lr"] == auto_outer_lr(2, 4)
    assert result.metrics[-1]["strategy_options"]["outer_lr"] == auto_outer_lr(2, 4)


def saved_without_outer_lr(run_dir):
    """Rewrite a run's checkpoints as the versions before auto wrote them: outer_lr, left to its
    default (then 0.7), not in the recorded config."""
    for meta in run_dir.glob("ckpt-*.json"):
        saved = json.loads(meta.read_text())
        del saved["config"]["outer_lr"]
        meta.write_text(json.dumps(saved))


@pytest.mark.parametrize("old", [True, False], ids=["saved-before-auto", "saved-with-0.7"])
def test_a_run_saved_with_0_7_resumes_with_0_7(tmp_path, old):
    run_dir = tmp_path / "r"
    args = ["sim", "--model", "tiny", "--seq-len", "16", "--batch-size", "4", "--workers", "4", "--steps", "8",
            "--sync-every", "4", "--run-dir", run_dir, "--sample-tokens", "0"]
    first = Run(tiny_config(workers=4, steps=8, outer_lr=0.7), run_dir, SimCommunicator(4), log=lambda m: None)
    first.train(stop_after=4)
    if old:
        saved_without_outer_lr(run_dir)
    assert auto_outer_lr(4, 4) != 0.7  # else the test could not tell them apart
    resumed = run_cli("sim", "--resume", "--run-dir", run_dir, "--sample-tokens", "0")
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads((run_dir / "config.json").read_text())["outer_lr"] == 0.7
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 8 and rows[-1]["strategy_options"]["outer_lr"] == 0.7
    fresh = run_cli(*args[:-4], "--run-dir", tmp_path / "new", "--sample-tokens", "0")  # a new run: auto
    assert fresh.returncode == 0, fresh.stderr
    assert json.loads((tmp_path / "new" / "config.json").read_text())["outer_lr"] == auto_outer_lr(4, 4)


def test_auto_is_refused_with_outer_adam_in_one_line():
    with pytest.raises(ConfigError, match="outer-lr auto is the rule for nesterov and sgd; with outer-optimizer adam "
                                          "pass a number"):
        DiLoCo(outer_optimizer="adam")
    assert DiLoCo(outer_optimizer="adam", outer_lr=0.05).outer_lr == 0.05


def test_flags_take_auto_or_a_number_and_help_says_what_auto_gives():
    help_text = " ".join(run_cli("sim", "--help").stdout.split())
    assert f"M=4: {auto_outer_lr(4, 30):g}, M=8: {auto_outer_lr(8, 30):g} at H = 30" in help_text
    assert "diloco, muloco, sparta-diloco, quorum: default auto" in help_text
    bad = run_cli("sim", "--outer-lr", "fast")
    assert bad.returncode == 2 and "'fast' is neither a number nor auto" in bad.stderr
    refused = run_cli("sim", "--strategy", "noloco", "--outer-lr", "auto", "--steps", "1")
    assert refused.returncode == 2 and 'outer-lr must be a number, not "auto"' in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
