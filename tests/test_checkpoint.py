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
    assert resumed.steps_done == 4
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


# ------------------------------------------------------------ the schema: one layout, versioned
def full_meta(**overrides):
    """A checkpoint's meta as a run passes it to save: run_folder.META's keys but layout and step."""
    return {"config": {"model": "tiny", "seq_len": 16, "batch_size": 4, "workers": 2, "steps": 12},
            "cursors": [{"epoch": 0, "pos": 8}, {"epoch": 0, "pos": 8}], "compute_s": 1.5,
            "worker_speeds": None, "exchanges": {"bytes_sent": 0, "log": []}, "model_preset": None,
            "vocab_size": 256, **overrides}


def arrays_tree(value: float):
    import mlx.core as mx
    return {"workers": {"params": {"w": mx.full((2, 3), value)}, "inner": {"m": mx.zeros((2, 3)), "step": mx.array(4)}},
            "strategy": {"fragments": [{"global": mx.full((3,), value, mx.bfloat16)}]}}


def test_save_and_load_keep_the_tree_the_schema_and_the_last_two(tmp_path):
    import mlx.core as mx
    from mlx_diloco import run_folder
    from mlx_diloco.training import checkpoint
    tree = arrays_tree(4.0)
    checkpoint.save(tmp_path, 4, tree, full_meta())
    assert tree == {}  # emptied as written: the checkpoint held the only references
    arrays, meta = checkpoint.load(tmp_path)
    assert meta == {**full_meta(), "layout": run_folder.LAYOUT, "step": 4}
    assert meta.keys() == run_folder.META.keys() and run_folder.read_meta(tmp_path, 4) == meta
    got, want = dict(tree_flatten(arrays)), dict(tree_flatten(arrays_tree(4.0)))
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and mx.array_equal(got[k], want[k]).item(), k
    for step in (8, 12):
        checkpoint.save(tmp_path, step, arrays_tree(step), full_meta())
    assert run_folder.steps(tmp_path) == [12, 8] and run_folder.latest_step(tmp_path) == 12  # KEEP = 2
    torn = tmp_path / "ckpt-12.safetensors"
    torn.write_bytes(torn.read_bytes()[:100])
    said = []
    arrays, meta = checkpoint.load(tmp_path, log=said.append)
    assert meta["step"] == 8 and arrays["workers"]["params"]["w"][0, 0].item() == 8
    assert len(said) == 1 and "checkpoint 12 is unreadable" in said[0] and "using checkpoint 8" in said[0]


def test_a_writer_writes_in_order_on_its_own_thread_and_a_failed_write_raises_on_the_runs(tmp_path):
    """Checkpoints written in the background equal those written at once, the newest last (a
    foreground save waits for the one in flight); a write that failed raises at the next save or
    wait, once, and the writer goes on."""
    import threading
    import mlx.core as mx
    from mlx_diloco import run_folder
    from mlx_diloco.training import checkpoint
    writer = checkpoint.Writer()
    for step in (4, 8):
        tree = arrays_tree(float(step))
        writer.save(tmp_path, step, tree, full_meta(), background=True)
        assert tree == {}  # staged: the writer holds the only references
    writer.save(tmp_path, 12, arrays_tree(12.0), full_meta())
    assert not [t for t in threading.enumerate() if t.name.startswith("checkpoint")]
    assert run_folder.steps(tmp_path) == [12, 8] and run_folder.latest_step(tmp_path) == 12
    arrays, _ = checkpoint.load(tmp_path, 8)
    got, want = dict(tree_flatten(arrays)), dict(tree_flatten(arrays_tree(8.0)))
    for k in want:
        assert got[k].dtype == want[k].dtype and mx.array_equal(got[k], want[k]).item(), k

    blocked = tmp_path / "a file"
    blocked.write_text("not a folder")
    writer.save(blocked, 16, arrays_tree(16.0), full_meta(), background=True)  # fails on its thread
    with pytest.raises(OSError):
        writer.wait()
    writer.wait()  # said once
    writer.save(blocked, 20, arrays_tree(20.0), full_meta(), background=True)
    with pytest.raises(OSError):
        writer.save(tmp_path, 24, arrays_tree(24.0), full_meta())
    writer.save(tmp_path, 24, arrays_tree(24.0), full_meta(), background=True)
    writer.wait()
    assert run_folder.latest_step(tmp_path) == 24


def test_fits_beside_reads_the_memory_limit():
    import mlx.core as mx
    from mlx_diloco.training import checkpoint
    state = {"w": mx.zeros((1000,))}  # 4 KB
    assert checkpoint.fits_beside(state)  # MLX's own limit
    assert not checkpoint.fits_beside(state, mx.get_peak_memory() + 3000)
    assert checkpoint.fits_beside(state, mx.get_peak_memory() + 5000)


@pytest.mark.parametrize("meta, why", [({k: v for k, v in full_meta().items() if k != "exchanges"},
                                        r"lacks \['exchanges'\]"),
                                       (full_meta(comm_s=0.1), r"\['comm_s'\] are not in run_folder.META")])
def test_save_writes_only_the_schema(tmp_path, meta, why):
    from mlx_diloco.training import checkpoint
    with pytest.raises(ValueError, match=why):
        checkpoint.save(tmp_path, 1, arrays_tree(1.0), meta)
    assert not list(tmp_path.iterdir())  # nothing written


def write_old_checkpoint(folder, step=4):
    """A checkpoint as mlx-diloco wrote it before checkpoint layouts (layout 1): no "layout" in its
    meta, the exchanges' accounting in keys of their own."""
    import mlx.core as mx
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / f"ckpt-{step}.safetensors"),
                        {"workers.params.wte.weight": mx.zeros((2, 8, 4)), "strategy.fragments.0.global.wte.weight":
                         mx.zeros((8, 4))}, {"format": "mlx-diloco", "step": str(step)})
    meta = {"config": {"model": "tiny", "seq_len": 16, "batch_size": 4, "workers": 2, "steps": 8, "sync_every": 2},
            "cursors": [{"epoch": 0, "pos": 16}, {"epoch": 0, "pos": 16}], "compute_s": 0.016,
            "comm_s": 0.0032, "bytes_sent": 168592, "worker_speeds": None, "peak_exchange_bytes": 84296,
            "exchange_log": [[3, 84296, 0], [3, 84296, 0]], "model_preset": None, "vocab_size": 256, "step": step}
    (folder / f"ckpt-{step}.json").write_text(json.dumps(meta, indent=1))
    (folder / "latest.json").write_text(json.dumps({"step": step}))


OLDER = (r"checkpoint 4 in .* was written by an older mlx-diloco \(checkpoint layout 1; this version reads "
         r"layout 2\); start a new run \(another --run-dir\), or resume, sample or export this one with the "
         r"version that wrote it")


def test_a_checkpoint_of_an_older_layout_is_one_line_on_resume_generate_and_export(tmp_path):
    import re
    write_old_checkpoint(tmp_path / "old")
    write_old_checkpoint(tmp_path / "old-2" / "worker-1")  # a run of two processes (sim --processes 2)
    write_old_checkpoint(tmp_path / "old-2")
    for args in [("sim", "--resume", "--run-dir", tmp_path / "old", "--sample-tokens", "0"),
                 ("sim", "--resume", "--run-dir", tmp_path / "old-2", "--sample-tokens", "0"),
                 ("generate", tmp_path / "old"), ("export", tmp_path / "old", tmp_path / "out")]:
        out = run_cli(*args)
        assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, (args, out.stderr[-2000:])
        assert re.search(OLDER, out.stderr), out.stderr


def test_a_checkpoint_of_a_newer_layout_asks_for_an_upgrade(tmp_path):
    from mlx_diloco import run_folder
    from mlx_diloco.training import checkpoint
    checkpoint.save(tmp_path, 4, arrays_tree(4.0), full_meta())
    meta = json.loads((tmp_path / "ckpt-4.json").read_text())
    (tmp_path / "ckpt-4.json").write_text(json.dumps({**meta, "layout": run_folder.LAYOUT + 1}))
    with pytest.raises(ConfigError, match=f"newer mlx-diloco \\(checkpoint layout {run_folder.LAYOUT + 1};"
                                          ".*upgrade mlx-diloco"):
        checkpoint.load(tmp_path)


def test_save_writes_a_tree_of_lazy_arrays_one_at_a_time(tmp_path):
    """The strategy's state offloaded to files is a tree of lazy reads: save holds one at a time."""
    import mlx.core as mx
    from mlx_diloco.training import checkpoint
    for i in range(8):
        mx.save_safetensors(str(tmp_path / f"part-{i}.safetensors"), {"x": mx.random.normal((1 << 20,))})

    def lazy_tree():
        return {"workers": {"params": {"w": mx.zeros((4,))}, "inner": {}},
                "strategy": {"fragments": [{"global": mx.load(str(tmp_path / f"part-{i}.safetensors"))["x"]}
                                           for i in range(8)]}}
    peaks = {}
    for name, save in {"all at once": lambda t: mx.save_safetensors(str(tmp_path / "ref.safetensors"),
                                                                     dict(tree_flatten(t))),
                       "save": lambda t: checkpoint.save(tmp_path / "run", 1, t, full_meta())}.items():
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        save(lazy_tree())
        peaks[name] = mx.get_peak_memory() - base
    assert peaks["save"] < 0.3 * peaks["all at once"]


@pytest.mark.parametrize("strategy, options", [("diloco", {}), ("diloco", dict(fragments=2, fragment_order="sequential")),
                                               ("ddp", {}), ("fedavg", {}), ("sparta", {}), ("demo", {}),
                                               ("muloco", {}), ("sparta-diloco", {})])
def test_export_reads_the_global_model_as_the_strategy_keeps_it(tmp_path, strategy, options):
    """export builds the run's strategy from the checkpoint and asks it for the global model: what
    a run resumed from that checkpoint holds. Mid-round (step 4 of a streaming run, whose first
    fragment synced at step 2), the workers' replicas are not the global model."""
    from mlx_diloco.tools.export import load_trained_model
    from mlx_diloco.strategies import STRATEGIES
    assert strategy in STRATEGIES
    config = tiny_config(strategy=strategy, steps=12, eval_every=4, **options)  # H = 4 where there is one
    Run(config, tmp_path / "r", SimCommunicator(2), log=lambda m: None).train(stop_after=6)  # checkpoint 4 is the last
    resumed = Run(config, tmp_path / "r", SimCommunicator(2), resume=True, log=lambda m: None)
    want = dict(tree_flatten(resumed.strategy.global_params(resumed.workers.params)))
    got = dict(tree_flatten(load_trained_model(tmp_path / "r")[0].trainable_parameters()))
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(np.array(got[k]), np.array(want[k]), err_msg=k)
