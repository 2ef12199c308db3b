"""What a new user still hit (issue 20, items 8, 11 and 12): short runs spent warming up, --resume
in several processes that did not fall back, and tracebacks where one line should say what to do.
Each test failed before its fix."""

import json
import os

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from conftest import run_cli
from mlx_diloco import DiLoCo, Trainer
from mlx_diloco.config import ConfigError, TrainConfig
from mlx_diloco.strategies.base import lr_schedule

TINY = ["--model", "tiny", "--seq-len", "16", "--batch-size", "4", "--workers", "4", "--eval-sequences", "8",
        "--sample-tokens", "0"]


def one_line_error(out, *expected):
    """The command failed on bad input with one error line, its last (no traceback, no second
    error), holding `expected`."""
    lines = out.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("mlx-diloco: error:")]
    assert out.returncode == 2 and errors == lines[-1:] and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert all(e in errors[0] for e in expected), errors[0]
    return errors[0]


# 8. the warmup is a share of the run, in sim and the API alike
def test_warmup_defaults_to_a_fifth_of_the_run_at_most_50_steps():
    lr = TrainConfig.lr
    short = lr_schedule(TrainConfig(steps=60))
    assert short(mx.array(12)).item() == pytest.approx(lr)  # warm after 12 steps, not 50
    assert short(mx.array(6)).item() == pytest.approx(lr / 2)
    readme = lr_schedule(TrainConfig())  # sim's default 500 steps: 50, as before
    assert readme(mx.array(25)).item() == pytest.approx(lr / 2) and readme(mx.array(50)).item() == pytest.approx(lr)
    assert lr_schedule(TrainConfig(steps=60, warmup=50))(mx.array(25)).item() == pytest.approx(lr / 2)  # as set
    # the cosine ends at final-lr of the peak: a tenth by default, the scaling-law paper's 5% when asked
    assert lr_schedule(TrainConfig(steps=60))(mx.array(60)).item() == pytest.approx(lr * 0.1)
    assert lr_schedule(TrainConfig(steps=60, final_lr=0.05))(mx.array(60)).item() == pytest.approx(lr * 0.05)
    with pytest.raises(ConfigError, match=r"final-lr must be a fraction of lr in \[0, 1\] \(got 5.0\)"):
        TrainConfig.from_dict({"final_lr": 5.0})
    # the API's defaults are sim's, defined once (the Trainer's settings are a TrainConfig)
    settings = Trainer(None, None, (np.zeros((4, 2)), np.zeros(4))).config
    for name in ("warmup", "lr", "batch_size", "weight_decay", "grad_clip", "eval_sequences", "link", "workers", "steps"):
        assert getattr(settings, name) == getattr(TrainConfig, name), name


# 11. --resume with several processes falls back past a torn checkpoint, as one process does
def test_resume_in_processes_falls_back_past_a_torn_checkpoint(tmp_path):
    run = tmp_path / "r"
    out = run_cli("sim", *TINY, "--steps", "8", "--sync-every", "4", "--processes", "2", "--run-dir", run)
    assert out.returncode == 0, out.stderr[-2000:]
    straight = json.loads((run / "summary.json").read_text())["final_eval_loss"]
    newest = run / "ckpt-8.safetensors"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # a crash while writing it
    out = run_cli("sim", "--resume", "--run-dir", run)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "checkpoint 8" in out.stderr and "using checkpoint 4" in out.stderr and "resumed" in out.stderr
    assert json.loads((run / "summary.json").read_text())["final_eval_loss"] == straight  # steps 5-8 again


@pytest.mark.parametrize("flags, expected", [
    (["--link", "moon"], "unknown link 'moon'"),
    (["--speed-policy", "time", "--strategy", "ddp"], "speed-policy time needs a strategy"),
    (["--loss", "badloss:per_example"], "returned an array of shape (4, 16), not a float scalar"),
], ids=["link", "speed-policy", "loss"])
def test_bad_input_in_processes_is_one_line_and_leaves_nothing(tmp_path, flags, expected):
    (tmp_path / "badloss.py").write_text(
        "import mlx.nn as nn\n\n"
        "def per_example(model, x, y):\n"
        "    return nn.losses.cross_entropy(model(x), y)  # no reduction: one loss per token\n")
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    out = run_cli("sim", *TINY, "--steps", "4", *flags, "--processes", "2", "--run-dir", tmp_path / "r",
                  env={"PYTHONPATH": path})
    assert "--resume" not in one_line_error(out, expected)
    assert not (tmp_path / "r").exists()


def test_a_crash_suggests_resume_only_when_there_is_a_checkpoint(tmp_path):
    import subprocess
    import sys
    from mlx_diloco.training.processes import failure
    procs = [subprocess.Popen([sys.executable, "-c", f"import sys; sys.exit({code})"]) for code in (0, 1)]
    for p in procs:
        p.wait()
    logs = [tmp_path / "log-0", tmp_path / "log-1"]
    logs[1].write_text("Traceback ...\nRuntimeError: boom\n")
    errors = [tmp_path / "error-0", tmp_path / "error-1"]
    said = failure(procs, logs, errors, tmp_path / "r")
    assert said.startswith("simulator process 1 of 2 failed (exit 1): RuntimeError: boom")
    assert "nothing to resume" in said and "--resume" not in said
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "latest.json").write_text('{"step": 4}')
    assert failure(procs, logs, errors, tmp_path / "r").endswith("resume it with --resume")
    errors[1].write_text("unknown link 'moon'; choose one of ...")  # bad input: its own line, as said
    assert failure(procs, logs, errors, tmp_path / "r") == "unknown link 'moon'; choose one of ..."


def test_a_sweeps_bad_grid_value_is_found_before_anything_is_written(tmp_path):
    out = run_cli("sweep", *TINY[:-2], "--steps", "2", "--grid", "seq_len=16,9999", "--out", tmp_path / "s")
    one_line_error(out, "seq-len 9999 exceeds model 'tiny' context 32")
    assert not (tmp_path / "s").exists()  # no sweep.json, no first point trained


# 12. one clear line instead of a traceback
def test_files_that_are_not_what_a_command_reads_get_one_line(tmp_path):
    binary = tmp_path / "metrics.jsonl"
    binary.write_bytes(bytes(range(256)) * 4)
    one_line_error(run_cli("plot", binary, "--out", tmp_path / "p.png"), "is not a metrics file", "not text")
    one_line_error(run_cli("gym", "compare", binary), "is not a scorecard", "not text")
    one_line_error(run_cli("sim", "--config", binary), "is not a config file", "not text")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text(json.dumps({"step": 0, "eval_loss": 1.0}) + "\n")
    one_line_error(run_cli("plot", tmp_path / "run", "--out", tmp_path / "p.txt"), "end --out in .png", ".svg")
    assert not (tmp_path / "p.txt").exists()


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(8, 3)

    def __call__(self, x):
        return self.l1(x)


def per_example_loss(model, x, y):
    return nn.losses.cross_entropy(model(x), y)  # no reduction


def int_loss(model, x, y):
    return 3


def mean_loss(model, x, y):
    return nn.losses.cross_entropy(model(x), y, reduction="mean")


@pytest.mark.parametrize("loss, got", [(per_example_loss, "an array of shape (16,)"), (int_loss, "int 3")])
def test_a_loss_that_is_not_a_float_scalar_is_one_line_before_the_run_folder(tmp_path, loss, got):
    x, y = np.random.default_rng(0).normal(size=(64, 8)).astype(np.float32), np.arange(64) % 3
    with pytest.raises(ConfigError, match="reduction=") as e:
        Trainer(MLP(), loss, (x, y), log=lambda m: None).fit(DiLoCo(sync_every=2), workers=2, steps=4,
                                                             run_dir=tmp_path / "r")
    assert f"returned {got}, not a float scalar" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "r").exists()


def test_fit_takes_a_strategy_or_its_name(tmp_path):
    x, y = np.random.default_rng(0).normal(size=(64, 8)).astype(np.float32), np.arange(64) % 3
    trainer = Trainer(MLP(), mean_loss, (x, y), batch_size=4, eval_sequences=8, log=lambda m: None)
    result = trainer.fit("diloco", workers=2, steps=4, run_dir=tmp_path / "r")
    assert result.summary["strategy"] == "diloco" and result.metrics[-1]["step"] == 4
    with pytest.raises(ConfigError, match=r"not the class DiLoCo; write DiLoCo\(\)"):
        trainer.fit(DiLoCo, workers=2, steps=4, run_dir=tmp_path / "c")
    with pytest.raises(ConfigError, match="unknown strategy 'dilocco'"):
        trainer.fit("dilocco", workers=2, steps=4, run_dir=tmp_path / "d")
    assert not (tmp_path / "c").exists() and not (tmp_path / "d").exists()
