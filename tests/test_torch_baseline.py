"""bench/torch_baseline.py computes what the project computes: the same GPT, AdamW, clipping and
schedule, from the same weights, give the same losses and parameters. Skipped without torch (an
optional extra: pip install -e '.[bench]')."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from mlx_diloco.config import TrainConfig  # noqa: E402
from mlx_diloco.exchange.comm import SimCommunicator  # noqa: E402
from mlx_diloco.models.zoo import build_model, count_parameters, load_spec  # noqa: E402
from mlx_diloco.strategies import make_strategy  # noqa: E402
from mlx_diloco.training.workers import Workers  # noqa: E402


ROOT = Path(__file__).resolve().parents[1]


def torch_baseline():
    path = ROOT / "bench" / "torch_baseline.py"
    spec = importlib.util.spec_from_file_location("torch_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("activation", ["relu", "gelu"])  # the small preset's, and the larger presets'
def test_baseline_trains_like_the_project(activation, tmp_path):
    tb = torch_baseline()
    preset = tmp_path / "small.json"
    small = json.loads((ROOT / "models" / "small.json").read_text())
    preset.write_text(json.dumps({**small, "activation": activation}))
    # Settings under which each part shows in 4 steps: warmup (the first update's lr is 0) then
    # the cosine, clipping that binds, weight decay large enough to move the weights visibly.
    config = TrainConfig.from_dict(dict(model=str(preset), workers=1, batch_size=4, seq_len=32, steps=20, warmup=2,
                                        lr=1e-2, weight_decay=1.0, grad_clip=0.5, sync_every=1000))
    model = build_model(load_spec(str(preset)), seed=3)
    strategy = make_strategy(config.strategy, config.strategy_options).for_job(1, config.steps).bind(
        SimCommunicator(1), config.steps)
    strategy.setup(model.trainable_parameters())
    ours = Workers(model, 1, config, strategy.inner_optimizer(config), log=lambda m: None)

    theirs = tb.GPT(**tb.read_gpt_preset(str(preset)))
    assert sum(p.numel() for p in theirs.parameters()) == count_parameters(model)
    start = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    theirs.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in start.items()})
    torch_step = tb.TrainStep(theirs, config)

    rng = np.random.default_rng(0)
    for step in range(1, 5):
        tokens = rng.integers(0, 1024, size=(4, 33))
        x, y = tokens[:, :-1], tokens[:, 1:]
        loss = ours.step(mx.array(x[None]), mx.array(y[None]), strategy, step)
        assert torch_step(torch.from_numpy(x), torch.from_numpy(y)) == pytest.approx(loss.item(), abs=1e-4)

    # Each parameter's change over the 4 steps, compared as a whole: AdamW divides by the root of the
    # squared gradient, so a weight whose gradient is ~0 (an inactive ReLU unit's) moves by float
    # noise times the learning rate; a difference in the computation moves them all.
    trained = dict(theirs.named_parameters())
    for name, p in tree_flatten(ours.params):
        ours_moved, theirs_moved = np.array(p[0]) - start[name], trained[name].detach().numpy() - start[name]
        assert np.linalg.norm(theirs_moved - ours_moved) <= 1e-3 * np.linalg.norm(ours_moved), name
