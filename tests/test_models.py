import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_diloco.exchange.comm import SimCommunicator
from mlx_diloco.models import fastmath
from mlx_diloco.config import TrainConfig
from mlx_diloco.data.datasets import FASHION_MNIST_DIR
from mlx_diloco.models.zoo import build_model, count_parameters, load_spec, preset_names
from mlx_diloco.training.run import Run


def test_presets_are_listed():
    assert {"tiny", "small", "gpt-10m", "gpt2-124m", "llama-150m", "llama-1b", "cnn"} <= set(preset_names())


@pytest.mark.parametrize("name, low, high", [("small", 1e6, 3e6), ("gpt-10m", 10e6, 15e6)])
def test_preset_sizes(name, low, high):
    assert low <= count_parameters(build_model(load_spec(name))) <= high


@pytest.mark.parametrize("name", ["tiny", "llama-tiny"])
def test_language_models_produce_logits(name):
    model = build_model(load_spec(name))
    assert model(mx.zeros((2, 8), dtype=mx.int32)).shape == (2, 8, 512)


@pytest.mark.skipif(not FASHION_MNIST_DIR.exists(), reason="needs Debian's dataset-fashion-mnist")
def test_cnn_learns_fashion_mnist(tmp_path):
    config = TrainConfig.from_dict(dict(model="cnn", data="fashion-mnist", workers=2, steps=30, sync_every=10,
                                        batch_size=32, warmup=5, eval_batches=4))
    run = Run(config, tmp_path / "cnn", SimCommunicator(2), log=lambda m: None)
    summary = run.train()
    first = float(__import__("json").loads((tmp_path / "cnn" / "metrics.jsonl").read_text().splitlines()[0])["eval_loss"])
    assert summary["final_eval_loss"] < first - 0.5


def test_softmax_and_cross_entropy_through_powers_of_two_match_mlx():
    """models/fastmath.py (the CPU's faster exponentials) computes what MLX's own functions do."""
    x = mx.random.normal((4, 8, 64)) * 5
    x = x + mx.triu(mx.full((64, 64), -mx.inf), k=1)[:8]  # a causal mask's -inf entries
    np.testing.assert_allclose(np.array(fastmath.softmax(x)), np.array(mx.softmax(x, axis=-1)), rtol=1e-5, atol=1e-7)
    logits, targets = mx.random.normal((4, 8, 100)) * 3, mx.random.randint(0, 100, (4, 8))
    ours = mx.value_and_grad(lambda z: fastmath.cross_entropy(z, targets))(logits)
    mlx = mx.value_and_grad(lambda z: nn.losses.cross_entropy(z, targets, reduction="mean"))(logits)
    for a, b in zip(ours, mlx):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-7)
