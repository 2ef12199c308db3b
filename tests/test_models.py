import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_diloco.exchange.comm import SimCommunicator
from mlx_diloco.models import fastmath
from mlx_diloco.config import ConfigError, TrainConfig
from mlx_diloco.data.datasets import fashion_mnist_places, find_fashion_mnist, is_fashion_mnist_folder
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


HAVE_FASHION_MNIST = any(is_fashion_mnist_folder(p) for p in fashion_mnist_places())


@pytest.mark.skipif(not HAVE_FASHION_MNIST, reason="needs Fashion-MNIST (Debian: dataset-fashion-mnist)")
def test_cnn_learns_fashion_mnist(tmp_path):
    config = TrainConfig.from_dict(dict(model="cnn", data="fashion-mnist", workers=2, steps=30, sync_every=10,
                                        batch_size=32, warmup=5, eval_sequences=128))
    run = Run(config, tmp_path / "cnn", SimCommunicator(2), log=lambda m: None)
    summary = run.train()
    first = float(__import__("json").loads((tmp_path / "cnn" / "metrics.jsonl").read_text().splitlines()[0])["eval_loss"])
    assert summary["final_eval_loss"] < first - 0.5


@pytest.mark.skipif(not HAVE_FASHION_MNIST, reason="needs Fashion-MNIST (Debian: dataset-fashion-mnist)")
def test_fashion_mnist_is_found_where_the_user_keeps_it(tmp_path, monkeypatch):
    """macOS has no Debian package: a folder given by --data, or by MLX_DILOCO_FASHION_MNIST; else
    an error naming where it looked and how to get the files."""
    folder = tmp_path / "my-fashion"
    folder.mkdir()
    for f in find_fashion_mnist().iterdir():
        (folder / f.name).symlink_to(f)
    config = TrainConfig.from_dict(dict(model="cnn", data=str(folder), workers=1, steps=1, batch_size=8))
    Run(config, tmp_path / "by-path", SimCommunicator(1), log=lambda m: None)  # --data FOLDER: an image model fits it
    monkeypatch.setenv("MLX_DILOCO_FASHION_MNIST", str(folder))
    assert find_fashion_mnist() == folder
    monkeypatch.setattr("mlx_diloco.data.datasets.fashion_mnist_places", lambda: [tmp_path / "nowhere"])
    with pytest.raises(ConfigError, match=r"Fashion-MNIST not found \(looked in .*nowhere\).*ubyte.gz.*--data FOLDER"):
        find_fashion_mnist()


def test_softmax_and_cross_entropy_through_powers_of_two_match_mlx():
    """models/fastmath.py (the CPU's faster exponentials) computes what MLX's own functions do."""
    x = mx.random.normal((4, 8, 64)) * 5
    x = x + mx.triu(mx.full((64, 64), -mx.inf), k=1)[:8]  # a causal mask's -inf entries
    np.testing.assert_allclose(np.array(fastmath.softmax(x)), np.array(mx.softmax(x, axis=-1)), rtol=1e-5, atol=1e-7)
    w = mx.random.normal(x.shape)  # the gradient, taken from the output alone (fastmath's own vjp)
    for z, axis in ((x, -1), (x[:, :, :8] * 0.5, 1)):
        ours, mlx = (mx.grad(lambda z: (f(z, axis=axis) * w[:, :, :z.shape[-1]]).sum())(z)
                     for f in (fastmath.softmax, mx.softmax))
        assert np.isfinite(np.array(ours)).all()
        np.testing.assert_allclose(np.array(ours), np.array(mlx), rtol=1e-4, atol=1e-6)
    logits, targets = mx.random.normal((4, 8, 100)) * 3, mx.random.randint(0, 100, (4, 8))
    ours = mx.value_and_grad(lambda z: fastmath.token_cross_entropy(z, targets).mean())(logits)
    mlx = mx.value_and_grad(lambda z: nn.losses.cross_entropy(z, targets, reduction="mean"))(logits)
    for a, b in zip(ours, mlx):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-7)
