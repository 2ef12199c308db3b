"""The command line end to end: train, plot, generate, export, doctor, and bad input."""

import json

import pytest

from conftest import run_cli

COMMON = ["--model", "tiny", "--seq-len", "16", "--batch-size", "4", "--workers", "2", "--steps", "8",
          "--eval-sequences", "8"]
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


@pytest.mark.parametrize("args, message", [
    (["--min-workers", "3"], "--min-workers must be between 1 and --workers (2), got 3"),
    (["--max-workers", "1"], "--max-workers (1) is below --workers (2)"),
    (["--max-workers", "3", "--strategy", "ddp"], "--max-workers needs a strategy that syncs every H steps"),
])
def test_launch_bounds_are_checked_in_one_line(tmp_path, args, message):
    """Before any agent is asked (none answers at this address)."""
    out = run_cli("launch", *COMMON, "--workers", "2", "--hosts", "127.0.0.1:9", *args, "--run-dir", tmp_path / "r",
                  env={"MLX_DILOCO_SECRET": "x" * 32})
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and message in out.stderr, out.stderr
    assert not (tmp_path / "r").exists()


def test_config_typo_is_named(tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"sync_evrey": 10}))
    out = run_cli("sim", "--config", cfg)
    assert out.returncode == 2 and "unknown config key 'sync_evrey'; did you mean 'sync_every'?" in out.stderr


def test_doctor_reports_blas_speed():
    out = run_cli("doctor")
    assert out.returncode == 0 and "GFLOP/s" in out.stdout and "ring" in out.stdout


# issue 20, item 13: what a new user reads
def test_sim_in_two_processes_says_things_once_and_prompts_for_its_corpus(tmp_path):
    corpus = tmp_path / "notes.txt"  # not Shakespeare, with 2 invalid UTF-8 sequences
    corpus.write_bytes(("naïve notes on trains and boats. " * 600).encode() + b"\xff\xfe" + b" end." * 50)
    out = run_cli("sim", *TINY, "--data", corpus, "--processes", "2", "--run-dir", tmp_path / "r",
                  "--sample-tokens", "3")
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("final eval loss") == 1 and out.stderr.count("2 invalid byte sequences") == 1
    assert "ROMEO" not in out.stdout  # the default prompt is Shakespeare's only


def test_generate_without_a_checkpoint_prints_only_the_error(tmp_path):
    out = run_cli("generate", tmp_path / "none")
    assert out.returncode == 2 and out.stdout == "" and "no checkpoint" in out.stderr


def test_plan_suggests_no_more_memory_than_here_and_explains_its_columns():
    import re
    from mlx_diloco.cluster.hostinfo import training_memory
    out = run_cli("plan", "--model", "llama-1b", "--batch-size", "4", "--total-steps", "1000", "--link", "wifi")
    assert out.returncode == 0, out.stderr
    limits = [float(x) for x in re.findall(r"--memory-limit ([\d.]+)", out.stdout)]
    assert limits and max(limits) <= training_memory() / 1e9 + 0.05  # 53.4 GB on a 24 GB machine before
    assert "fragment: one exchange of 1/P" in out.stdout and "single, DDP, DiLoCo: time to train" in out.stdout


def test_doctor_says_how_it_sizes_image_models():
    from mlx_diloco.tools.doctor import preset_lines
    lines = preset_lines()
    assert "image models at batch 4" in lines[0] and "cnn (images)" in "\n".join(lines)
