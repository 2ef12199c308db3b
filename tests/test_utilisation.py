"""Where the time goes and MFU: the FLOPs per token against a count of the model's own matrix
multiplies, and the split of a wait on peers into the link and a slower worker, over the real ring."""

import json

import mlx.nn as nn
import pytest

from conftest import tiny_config
from mlx_diloco.machine.memory import model_shape
from mlx_diloco.models.finetune import apply_fine_tune
from mlx_diloco.models.zoo import build_model, count_parameters, load_spec
from mlx_diloco.machine.utilisation import flops_per_token, mfu
from test_ring import run_ranks


def multiplied_weights(model) -> int:
    """Weights that multiply activations, counted from the built modules: every Linear's, and the
    token embedding once more where the head is tied to it (GPT's `as_linear`)."""
    linear = sum(m.weight.size for _, m in model.named_modules() if isinstance(m, nn.Linear))
    return linear + (model.wte.weight.size if hasattr(model, "wte") else 0)


def test_flops_per_token_counts_every_multiply_of_a_gpt():
    spec = load_spec("small")
    model = build_model(spec)
    p, T = spec.params, 64
    want = 6 * multiplied_weights(model) + 12 * p["n_layer"] * p["n_embd"] * T
    got = flops_per_token(model_shape(p, count_parameters(model)), T)
    # the count from the shape also takes the norms' and position embedding's few weights as multiplied
    assert got == pytest.approx(want, rel=0.02) and got >= want


def test_frozen_weights_cost_two_thirds_and_image_models_have_no_flops_per_token():
    spec = load_spec("small")
    shape = model_shape(spec.params, 1_000_000)
    full = flops_per_token(shape, 0)
    shape.trainable = 10_000  # adapters: the base's weights get no gradient of their own
    assert flops_per_token(shape, 0) == 4 * 1_000_000 + 6 * 10_000 and full == 6 * 1_000_000
    assert flops_per_token(model_shape(load_spec("cnn").params, 50_000), 0) is None
    assert mfu(None, 1000.0, 100.0) is None and mfu(6e6, 1000.0, 100.0) == pytest.approx(0.06)


def test_lora_run_reports_mfu_of_the_frozen_base(tmp_path):
    """A LoRA run counts its frozen base at 4 FLOPs per weight and token: less than full training."""
    from mlx_diloco.training.run import model_flops_per_token
    config = tiny_config(model="llama-tiny", fine_tune_type="lora", num_layers=2)
    spec = load_spec(config.model)
    model = apply_fine_tune(build_model(spec), config)
    lora = model_flops_per_token(model, spec, config)
    full = model_flops_per_token(build_model(spec), spec, tiny_config(model="llama-tiny"))
    assert lora < full < 1.6 * lora


# Rank 0 arrives 0.6 s late at the exchange: rank 1 spends that waiting for the slower worker, not the link.
LATE = """
import json, sys, time
import mlx.core as mx
from mlx_diloco.exchange.ring import init_ring
comm = init_ring(60)
rank = comm.local_workers[0]
comm.all_mean({"w": mx.ones((1, 1000))})  # connected, in step
if rank == 0:
    time.sleep(0.6)
comm.all_mean({"w": mx.ones((1, 1000))})
print(json.dumps({"wait_s": comm.wait_s, "straggler_s": comm.straggler_s}))
"""


def test_a_wait_for_a_late_worker_counts_as_waiting_for_slower_workers(tmp_path):
    outs = [json.loads(out) for out, _ in run_ranks(tmp_path, 2, ["-c", LATE])]
    late, waiting = outs
    assert 0.5 < waiting["straggler_s"] <= waiting["wait_s"] < 0.5 + 0.6, waiting
    assert waiting["wait_s"] - waiting["straggler_s"] < 0.1, waiting  # 4 KB on 127.0.0.1
    assert late["straggler_s"] < 0.05, late


def test_sim_reports_time_spent_and_mfu(tmp_path):
    from mlx_diloco.training.processes import simulate
    summary = simulate(tiny_config(workers=2, steps=4, sync_every=2), tmp_path / "run", processes=1, log=lambda m: None)
    assert summary["mfu"] is not None and 0 < summary["mfu"] < 1 and summary["peak_gflops"] > 0
    assert summary["link_s"] >= 0 and summary["straggler_s"] == 0  # one process: no peer to wait for
    assert 0 < summary["measured_utilisation"] <= 1
    rows = (tmp_path / "run" / "exchanges.jsonl").read_text().splitlines()
    assert all("straggler_s" in json.loads(r) for r in rows) and rows


def test_a_peak_measured_on_a_busy_machine_is_raised_and_no_mfu_passes_100_percent(tmp_path, monkeypatch):
    """The default sim on an idle machine reported MFU 108%: the matmul peak it divided by was
    measured once while other work ran, and kept for good. A run faster than the kept peak measures
    it again and keeps the best (at least its own rate); doctor's measurement never lowers it."""
    from mlx_diloco.training.processes import simulate
    from mlx_diloco.machine.utilisation import _cache_path, _machine_key, matmul_gflops, peak_gflops
    monkeypatch.setenv("MLX_DILOCO_CACHE", str(tmp_path / "cache"))
    _cache_path().parent.mkdir(parents=True)
    _cache_path().write_text(json.dumps({_machine_key(): 0.01}))  # 10 MFLOP/s: as if measured under a load
    summary = simulate(tiny_config(workers=2, steps=8, sync_every=2), tmp_path / "run", processes=1, log=lambda m: None)
    kept = json.loads(_cache_path().read_text())[_machine_key()]
    print(f"\nMFU {summary['mfu']:.3f} of a peak raised from 0.01 to {kept:.1f} GFLOP/s")
    assert 0 < summary["mfu"] <= 1 and summary["peak_gflops"] == kept > 1
    _cache_path().write_text(json.dumps({_machine_key(): 1e6}))  # a best measured before: doctor keeps it
    assert peak_gflops(beaten_by=matmul_gflops()) == 1e6
