"""The command line end to end: train, plot, generate, export, doctor, and bad input."""

import json

import pytest

from conftest import run_cli

COMMON = ["--model", "tiny", "--seq-len", "16", "--batch-size", "4", "--workers", "2", "--steps", "8",
          "--eval-batches", "2"]
TINY = COMMON + ["--sync-every", "4"]


def test_sim_plot_generate(tmp_path):
    out = run_cli("sim", *TINY, "--run-dir", tmp_path / "a", "--sample-tokens", "5")
    assert out.returncode == 0, out.stderr
    assert "final eval loss" in out.stdout and "sample:" in out.stdout
    rows = [json.loads(l) for l in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 8 and rows[-1]["eval_loss"] < rows[0]["eval_loss"]
    assert rows[-1]["bytes_sent_per_worker"] > 0 and 0 < rows[-1]["utilisation"] <= 1
    # local models are evaluated before the outer step: they differ, having read different shards
    assert len(set(rows[-1]["eval_loss_workers"])) == 2
    assert run_cli("sim", *COMMON, "--strategy", "ddp", "--run-dir", tmp_path / "b", "--sample-tokens", "0").returncode == 0

    png = tmp_path / "loss.png"
    assert run_cli("plot", tmp_path / "a", tmp_path / "b", "--out", png).returncode == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    gen = run_cli("generate", tmp_path / "a", "--prompt", "KING", "--max-tokens", "10")
    assert gen.returncode == 0 and gen.stdout.startswith("KING") and len(gen.stdout) > 6


def test_export_llama_loads_in_mlx_lm(tmp_path):
    out = run_cli("sim", *TINY, "--model", "llama-tiny", "--run-dir", tmp_path / "l", "--sample-tokens", "0")
    assert out.returncode == 0, out.stderr
    assert run_cli("export", tmp_path / "l", tmp_path / "export").returncode == 0
    from mlx_lm import load
    model, tokenizer = load(str(tmp_path / "export"))
    assert len(tokenizer.encode("Hello there")) > 0


@pytest.mark.parametrize("args, message", [
    (["--model", "nope"], "unknown model preset 'nope'"),
    (["--data", "/no/such/file.txt"], "does not exist"),
    (["--sync-every", "0"], "sync-every (H) must be >= 1"),
    (["--workers", "0"], "workers must be >= 1"),
    (["--strategy", "magic"], "unknown strategy 'magic'"),
    (["--strategy", "ddp"], "'sync_every' is an option of diloco"),  # never silently ignored
])
def test_bad_input_one_clear_line(tmp_path, args, message):
    out = run_cli("sim", *TINY, *args, "--run-dir", tmp_path / "r")
    assert out.returncode == 2
    assert message in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()


def test_config_typo_is_named(tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"sync_evrey": 10}))
    out = run_cli("sim", "--config", cfg)
    assert out.returncode == 2 and "unknown config key 'sync_evrey'; did you mean 'sync_every'?" in out.stderr


def test_doctor_reports_blas_speed():
    out = run_cli("doctor")
    assert out.returncode == 0 and "GFLOP/s" in out.stdout and "ring" in out.stdout
