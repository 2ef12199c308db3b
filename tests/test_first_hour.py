"""What a new user hits first (issue 8): each test failed before its fix. The numbers in the
comments are the issue's items."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from conftest import run_cli, tiny_config
from mlx_diloco import run_folder
from mlx_diloco.exchange.comm import SimCommunicator
from mlx_diloco.config import ConfigError, TrainConfig
from mlx_diloco.data.datasets import load_text
from mlx_diloco.training.resolve import resolve
from mlx_diloco.training.run import Run

QUIET = dict(log=lambda m: None)
TINY = ["--model", "tiny", "--batch-size", "4", "--workers", "2", "--eval-sequences", "8", "--sample-tokens", "0"]


def rows_of(run_dir):
    return [json.loads(l) for l in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


# 1. every run ends with a final sync and a final checkpoint
@pytest.mark.parametrize("strategy", ["diloco", "fedavg"])
def test_run_ends_synced_when_h_does_not_divide_steps(tmp_path, strategy):
    run = Run(tiny_config(strategy=strategy, steps=10, sync_every=4), tmp_path / "r", SimCommunicator(2), **QUIET)
    run.train()
    assert run_folder.latest_step(tmp_path / "r") == 10
    final = dict(tree_flatten(run.global_params()))
    for name, local in tree_flatten(run.workers.params):  # every replica holds the final global model
        for w in range(2):
            np.testing.assert_array_equal(np.array(local[w]), np.array(final[name]), err_msg=name)
    rows = rows_of(tmp_path / "r")
    assert [r["step"] for r in rows] == [0, 4, 8, 10] and rows[-1]["eval_loss"] != rows[-2]["eval_loss"]


def test_run_shorter_than_h_trains_and_checkpoints(tmp_path):
    run = Run(tiny_config(steps=6, sync_every=50), tmp_path / "r", SimCommunicator(2), **QUIET)
    summary = run.train()
    rows = rows_of(tmp_path / "r")
    assert summary["final_eval_loss"] < rows[0]["eval_loss"] and run_folder.latest_step(tmp_path / "r") == 6


# 2. config values are type- and range-checked, with one line naming the key
@pytest.mark.parametrize("params, message", [
    ({"workers": "4"}, "workers must be a whole number, not \"4\""),
    ({"lr": "0.001"}, "lr must be a number, not \"0.001\""),
    ({"vectorize": "false"}, "vectorize must be true or false"),
    ({"steps": 20.5}, "steps must be a whole number, not 20.5"),
    ({"beta2": 1.5}, "beta2 must be in [0, 1)"),
    ({"outer_lr": 0}, "outer-lr must be > 0"),
    ({"outer_lr": float("inf")}, "outer-lr must be a finite number, not inf"),  # (JSON's Infinity)
    ({"lr": float("nan")}, "lr must be a finite number, not nan"),
    ({"grad_clip": -1}, "grad-clip must be >= 0"),
    ({"warmup": -5}, "warmup must be >= 0"),
    (["workers", 4], "config keys must be a JSON object"),
])
def test_config_values_are_checked(tmp_path, params, message):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(params))
    with pytest.raises(ConfigError) as e:
        resolve(TrainConfig.from_file(path))  # the strategy's options are checked where it is built
    assert message in str(e.value)


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e400"])
def test_an_outer_lr_that_is_not_finite_is_refused_up_front(tmp_path, value):
    out = run_cli("sim", f"--outer-lr={value}", "--run-dir", tmp_path / "r")
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        f"mlx-diloco: error: outer-lr must be a finite number, not {float(value)}; write e.g. \"outer_lr\": \"auto\""]
    assert not (tmp_path / "r").exists()


def test_config_type_error_is_one_line_even_with_an_overriding_flag(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps({"workers": "4"}))
    out = run_cli("sim", "--config", tmp_path / "c.json", "--workers", "2")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert "workers must be a whole number" in out.stderr
    assert TrainConfig.from_dict({"lr": 1, "vectorize": False}).lr == 1.0  # an int is a float


# 3. small corpora train; too small ones say how much text is needed
def test_small_corpus_trains(tmp_path):
    words = "the quick brown fox jumps over the lazy dog and then it sleeps in the warm sun while birds sing".split()
    rng = np.random.default_rng(0)
    (tmp_path / "small.txt").write_text(" ".join(rng.choice(words, 2000)))  # about 10 kB
    config = tiny_config(data=str(tmp_path / "small.txt"), batch_size=16, eval_sequences=128, steps=4)
    assert Run(config, tmp_path / "r", SimCommunicator(2), **QUIET).train()["final_eval_loss"] > 0


def test_too_small_corpus_says_how_much_is_needed(tmp_path):
    (tmp_path / "t.txt").write_text("All the world's a stage. " * 45)  # 1.1 kB, about 270 tokens
    with pytest.raises(ConfigError, match=r"give at least 325 tokens \(about \d+ kB of text\)"):
        Run(tiny_config(data=str(tmp_path / "t.txt"), model="small", seq_len=64), tmp_path / "r",
            SimCommunicator(2), **QUIET)


# 4. binary files are refused; Latin-1 text is decoded; broken UTF-8 is counted
def test_binary_file_is_refused(tmp_path):
    (tmp_path / "prog.txt").write_bytes(Path(sys.executable).read_bytes()[:200_000])
    with pytest.raises(ConfigError, match="is not text"):
        load_text(str(tmp_path / "prog.txt"))


def test_latin1_and_broken_utf8(tmp_path):
    (tmp_path / "latin.txt").write_bytes("Le café du théâtre, façade — ".encode("cp1252") * 100)
    said = []
    assert "café du théâtre, façade —" in load_text(str(tmp_path / "latin.txt"), log=said.append)
    assert "not UTF-8" in said[0]
    (tmp_path / "broken.txt").write_bytes(("naïve text " * 200).encode() + b"\xff\xfe\xff" + b" end" * 100)
    said = []
    load_text(str(tmp_path / "broken.txt"), log=said.append)
    assert "3 invalid byte sequences" in said[0]


# 5 and 8. a model folder (and any mlx-lm architecture) works from any directory
def test_qwen3_preset_and_model_folder_from_another_directory(tmp_path):
    preset = tmp_path / "qwen3-tiny.json"
    preset.write_text(json.dumps({"type": "qwen3", "vocab_size": 512, "hidden_size": 32, "intermediate_size": 64,
                                  "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                                  "head_dim": 16, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                                  "max_position_embeddings": 32, "tie_word_embeddings": True}))
    out = run_cli("sim", *TINY, "--model", preset, "--steps", "4", "--sync-every", "2", "--run-dir", tmp_path / "q")
    assert out.returncode == 0, out.stderr[-2000:]
    assert run_cli("export", tmp_path / "q", tmp_path / "qwen3-model").returncode == 0
    assert json.loads((tmp_path / "qwen3-model" / "config.json").read_text())["model_type"] == "qwen3"

    # Fine-tune the exported folder, named by a relative path; use the run from elsewhere.
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    out = run_cli("sim", *TINY, "--model", "../qwen3-model", "--steps", "4", "--sync-every", "2",
                  "--run-dir", "ft", cwd=tmp_path / "a")
    assert out.returncode == 0, out.stderr[-2000:]
    gen = run_cli("generate", "../a/ft", "--max-tokens", "3", cwd=tmp_path / "b")
    assert gen.returncode == 0, gen.stderr[-2000:]
    assert run_cli("export", "../a/ft", "exported", cwd=tmp_path / "b").returncode == 0
    resumed = run_cli("sim", "--resume", "--run-dir", "../a/ft", "--sample-tokens", "0", cwd=tmp_path / "b")
    assert resumed.returncode == 0 and "resumed" in resumed.stderr, resumed.stderr[-2000:]


def test_misspelled_mlx_lm_option_and_unknown_type(tmp_path):
    from mlx_diloco.models.zoo import load_spec
    (tmp_path / "a.json").write_text(json.dumps({"type": "llama", "hiden_size": 32}))
    with pytest.raises(ConfigError, match="llama has no option 'hiden_size'; did you mean 'hidden_size'"):
        load_spec(str(tmp_path / "a.json"))
    (tmp_path / "b.json").write_text(json.dumps({"type": "transformer9"}))
    with pytest.raises(ConfigError, match="unknown type 'transformer9'"):
        load_spec(str(tmp_path / "b.json"))


# 6. resume falls back by itself to the newest intact checkpoint
def test_resume_falls_back_to_an_intact_checkpoint(tmp_path):
    config = tiny_config(steps=12, sync_every=4)
    Run(config, tmp_path / "r", SimCommunicator(2), **QUIET).train()
    ckpt = tmp_path / "r" / "ckpt-12.safetensors"
    ckpt.write_bytes(ckpt.read_bytes()[:100])
    said = []
    run = Run(config, tmp_path / "r", SimCommunicator(2), resume=True, log=said.append)
    assert run.steps_done == 8 and any("checkpoint 12 is unreadable" in m and "using checkpoint 8" in m for m in said)

    (tmp_path / "r" / "latest.json").write_text('{"st')  # torn pointer: the newest intact checkpoint counts
    assert Run(config, tmp_path / "r", SimCommunicator(2), resume=True, **QUIET).steps_done == 8


# 7. defaults that work, and one clear line for each mistake
def test_tiny_model_with_default_seq_len(tmp_path):
    out = run_cli("sim", *TINY, "--steps", "2", "--run-dir", tmp_path / "r")
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads((tmp_path / "r" / "config.json").read_text())["seq_len"] == 32  # tiny's context


def test_mistakes_outside_sim_get_their_own_line(tmp_path):
    gen = run_cli("generate", tmp_path)
    assert gen.returncode == 2 and "no checkpoint" in gen.stderr and "--resume" not in gen.stderr
    (tmp_path / "notes.txt").write_text("not json\n")
    plot = run_cli("plot", tmp_path / "notes.txt", "--out", tmp_path / "p.png")
    assert plot.returncode == 2 and "is not a metrics file" in plot.stderr and len(plot.stderr.splitlines()) == 1
    disc = run_cli("discover", "--hosts", "127.0.0.1:1", env={"MLX_DILOCO_SECRET": ""})
    assert disc.returncode == 2 and "cluster secret" in disc.stderr
    disc = run_cli("discover", "--hosts", "127.0.0.1:1", env={"MLX_DILOCO_SECRET": "s" * 20})
    assert disc.returncode == 2 and "no agent answered" in disc.stderr


def test_export_refuses_a_non_empty_folder(tmp_path):
    assert run_cli("sim", *TINY, "--model", "llama-tiny", "--steps", "2", "--run-dir", tmp_path / "r").returncode == 0
    before = (tmp_path / "r" / "config.json").read_text()
    out = run_cli("export", tmp_path / "r", tmp_path / "r")
    assert out.returncode == 2 and "is not empty" in out.stderr
    assert (tmp_path / "r" / "config.json").read_text() == before


def test_ctrl_c_hint_names_the_command_and_run(tmp_path):
    env = {**os.environ, "MLX_DILOCO_SECRET": ""}
    cases = [(["discover", "--discover-timeout", "60"], None),
             (["sim", *TINY, "--steps", "100000", "--run-dir", str(tmp_path / "r")],
              f"mlx-diloco sim --resume --run-dir {tmp_path / 'r'}")]
    for args, hint in cases:
        proc = subprocess.Popen([sys.executable, "-m", "mlx_diloco", *args], stderr=subprocess.PIPE, text=True, env=env)
        deadline = time.time() + 60
        while hint and not (tmp_path / "r" / "metrics.jsonl").exists() and time.time() < deadline:
            time.sleep(0.2)  # the run has started training
        time.sleep(3)
        proc.send_signal(signal.SIGINT)
        err = proc.communicate(timeout=60)[1]
        assert proc.returncode == 130 and "interrupted" in err
        assert ("sim --resume" not in err) if hint is None else (hint in err), err[-500:]


# 10. the launcher cuts shards without building the model
def test_shards_are_cut_without_building_the_model(tmp_path):
    from mlx_diloco.cluster.launcher import cut_shards
    (tmp_path / "t.txt").write_text(load_text("shakespeare")[:200_000])
    config = TrainConfig.from_dict({"model": "llama-1b", "data": str(tmp_path / "t.txt"), "seq_len": 64, "workers": 2})
    mx.reset_peak_memory()
    files = cut_shards(config, 2, tmp_path / "shards", **QUIET)
    assert sorted(files) == ["0", "1"] and "train.npy" in files["0"]
    assert mx.get_peak_memory() < 100e6  # llama-1b's weights alone are 4.4 GB


# 11. small things
def test_every_imported_package_is_declared():
    import ast
    import tomllib
    root = Path(__file__).resolve().parent.parent
    declared = {d.split(";")[0].split("[")[0].split(">")[0].split("=")[0].strip().replace("-", "_")
                for d in tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]}
    imported = set()
    for path in (root / "mlx_diloco").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                imported.add(node.module.split(".")[0])
    third_party = imported - set(sys.stdlib_module_names) - {"mlx_diloco"}
    # a module's distribution may be named otherwise (yaml is PyYAML's): any of them declared will do
    from importlib.metadata import packages_distributions
    installed_by = packages_distributions()
    undeclared = {m for m in third_party
                  if not {d.lower().replace("-", "_") for d in installed_by.get(m, [m])} & {d.lower() for d in declared}}
    assert not undeclared, undeclared


def test_worker_failure_names_the_last_line_not_a_list(tmp_path):
    from mlx_diloco.cluster.launcher import JobState, Launcher, Member
    from mlx_diloco.cluster.job_files import Mirror
    from mlx_diloco.cluster.supervisor import Heartbeat
    state = JobState("j", tiny_config().to_dict(), [Member("127.0.0.1", 1, 0, "mini")], 1, {})
    launcher = Launcher(state, tmp_path, b"s" * 20, **QUIET)
    launcher.started_at = time.time()
    failure = Heartbeat(launcher, Mirror(tmp_path)).failure({0: {"state": "exited", "returncode": 1, "progress": None,
                                                                 "log_tail": "Traceback...\nValueError: boom\n"}})
    assert failure.why.endswith("exited with code 1: ValueError: boom")


# issue 20, item 13: what a new user reads
@pytest.mark.parametrize("params, hint", [
    ({"workers": "4"}, '"workers": 4'), ({"lr": "3e-4"}, '"lr": 0.0003'), ({"workers": "four"}, '"workers": 4'),
    ({"vectorize": "true"}, '"vectorize": true'), ({"strategy_options": {"sync_every": 2.5}}, '"sync_every": 50'),
])
def test_type_error_hints_show_a_valid_value(params, hint):
    with pytest.raises(ConfigError) as e:
        resolve(TrainConfig.from_dict(params))
    assert hint in str(e.value)  # before: "workers": 0, "lr": 0.0, "sync_every": 0


def api_fit(model, inputs, targets, said, tmp_path, batch_size: int):
    from mlx_diloco import DiLoCo, Trainer
    return Trainer(model, None, (inputs, targets), batch_size=batch_size, run_dir=tmp_path, log=said.append).fit(
        DiLoCo(sync_every=3), workers=2, steps=6)


def test_api_counts_tokens_of_sequences_and_examples_of_other_data(tmp_path):
    import mlx.nn as nn
    rng = np.random.default_rng(0)
    seqs, said = rng.integers(0, 50, (64, 32)), []
    fit = api_fit(nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 50)), seqs, np.roll(seqs, -1, 1), said,
                  tmp_path / "t", batch_size=4)
    assert fit.summary["examples"] == 2 * 6 * 4 and fit.summary["tokens"] == 2 * 6 * 4 * 32  # was 48: rows
    assert not any("larger than" in m for m in said)
    features = rng.normal(size=(10, 8)).astype(np.float32)
    fit = api_fit(nn.Linear(8, 3), features, rng.integers(0, 3, 10), said, tmp_path / "f", batch_size=16)
    assert fit.summary["tokens"] is None and fit.summary["examples"] == 2 * 6 * 16
    # 16 a batch from the 5 examples a worker has: said, once
    assert sum("batch size 16 is larger than a worker's share of the training data (5 examples)" in m
               for m in said) == 1


def test_fit_without_a_run_dir_leaves_no_folder(tmp_path):
    script = ("import numpy as np, mlx.nn as nn\n"
              "from mlx_diloco import Trainer, DiLoCo\n"
              "x = np.random.default_rng(0).normal(size=(32, 4)).astype(np.float32)\n"
              "r = Trainer(nn.Linear(4, 3), None, (x, np.zeros(32, dtype=np.int32)), batch_size=4, log=lambda m: None)"
              ".fit(DiLoCo(sync_every=2), workers=2, steps=4)\n"
              "print(r.run_dir, r.run_dir.exists())\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    folder, existed = out.stdout.split()
    assert existed == "True" and not Path(folder).exists()


def test_resuming_a_finished_run_keeps_its_peak_memory(tmp_path):
    args = ["sim", "--model", "tiny", "--seq-len", "16", "--batch-size", "4", "--workers", "2", "--steps", "4",
            "--sync-every", "2", "--eval-sequences", "8", "--processes", "1", "--sample-tokens", "0",
            "--run-dir", tmp_path / "r"]
    assert run_cli(*args).returncode == 0
    peak = json.loads((tmp_path / "r" / "summary.json").read_text())["peak_memory_bytes"]
    out = run_cli("sim", "--resume", "--run-dir", tmp_path / "r", "--sample-tokens", "0")
    assert out.returncode == 0, out.stderr
    resumed = json.loads((tmp_path / "r" / "summary.json").read_text())["peak_memory_bytes"]
    assert resumed >= 0.8 * peak  # before: the resumed process's own peak, a few percent of it
