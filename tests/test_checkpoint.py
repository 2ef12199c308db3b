"""Checkpoints: an interrupted and resumed run ends exactly where an uninterrupted one does."""

import json

import numpy as np
import pytest
from mlx.utils import tree_flatten

from conftest import run_cli, tiny_config
from mlx_diloco.exchange.comm import SimCommunicator
from mlx_diloco.config import ConfigError
from mlx_diloco.training.run import Run


def final_params(run):
    return {k: np.array(v) for k, v in tree_flatten(
        {"global": run.strategy.global_params(run.workers.params), "local": run.workers.params})}


@pytest.mark.parametrize("strategy", ["diloco", "ddp"])
def test_resume_matches_uninterrupted(tmp_path, strategy):
    config = tiny_config(strategy=strategy, steps=12, eval_every=4)  # H = 4 where the strategy has one
    straight = Run(config, tmp_path / "straight", SimCommunicator(2), log=lambda m: None)
    straight.train()

    first = Run(config, tmp_path / "split", SimCommunicator(2), log=lambda m: None)
    first.train(stop_after=6)  # dies mid-round: the checkpoint at step 4 is the last one
    resumed = Run(config, tmp_path / "split", SimCommunicator(2), resume=True, log=lambda m: None)
    assert resumed.step == 4
    resumed.train()

    a, b = final_params(straight), final_params(resumed)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    rows = [json.loads(l) for l in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 4, 8, 12]  # rows of the lost work were dropped


def test_no_intact_checkpoint_is_a_clear_error(tmp_path):
    config = tiny_config(steps=4)
    Run(config, tmp_path / "r", SimCommunicator(2), log=lambda m: None).train()
    ckpt = tmp_path / "r" / "ckpt-4.safetensors"
    ckpt.write_bytes(ckpt.read_bytes()[:100])
    with pytest.raises(ConfigError, match="no intact checkpoint .* checkpoint 4 is unreadable"):
        Run(config, tmp_path / "r", SimCommunicator(2), resume=True, log=lambda m: None)


def test_cli_resume_and_refusal_to_overwrite(tmp_path):
    run_dir = tmp_path / "run"
    args = ["sim", "--model", "tiny", "--seq-len", "16", "--batch-size", "4", "--workers", "2",
            "--steps", "8", "--sync-every", "4", "--run-dir", run_dir, "--sample-tokens", "0"]
    assert run_cli(*args).returncode == 0
    before = (run_dir / "metrics.jsonl").read_text()
    again = run_cli(*args)
    assert again.returncode == 2
    assert "already holds a run" in again.stderr and len(again.stderr.strip().splitlines()) == 1
    assert (run_dir / "metrics.jsonl").read_text() == before  # nothing overwritten
    resumed = run_cli("sim", "--resume", "--run-dir", run_dir, "--sample-tokens", "0")
    assert resumed.returncode == 0, resumed.stderr


def test_checkpoints_are_written_one_array_at_a_time(tmp_path):
    """Arrays that are lazy reads of other files (the offloaded outer state) are in memory one at
    a time while a checkpoint is written; the file reads back as mx.save_safetensors' would."""
    import mlx.core as mx
    from mlx_diloco.training.checkpoint import write_safetensors
    for i in range(8):
        mx.save_safetensors(str(tmp_path / f"part-{i}.safetensors"), {"x": mx.random.normal((1 << 20,))})
    odd = {"bf16": mx.arange(5).astype(mx.bfloat16), "flag": mx.array([True, False]), "step": mx.array(7),
           "matrix": mx.arange(12, dtype=mx.int32).reshape(3, 4)[:, 1:]}

    def lazy_parts():
        return {f"part-{i}": mx.load(str(tmp_path / f"part-{i}.safetensors"))["x"] for i in range(8)}
    peaks = {}
    for name, save in {"all at once": lambda d: mx.save_safetensors(str(tmp_path / "ref.safetensors"), d),
                       "streamed": lambda d: write_safetensors(tmp_path / "out.safetensors", d, {"a": "b"})}.items():
        flat = {**lazy_parts(), **odd}
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        save(flat)
        peaks[name] = mx.get_peak_memory() - base
    assert peaks["streamed"] < 0.3 * peaks["all at once"]
    ref, out = mx.load(str(tmp_path / "ref.safetensors")), mx.load(str(tmp_path / "out.safetensors"))
    assert ref.keys() == out.keys()
    for k in ref:
        assert ref[k].dtype == out[k].dtype and mx.array_equal(ref[k], out[k]).item(), k
