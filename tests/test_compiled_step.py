"""The compiled inner step: traced once, and the same training as the step run op by op."""

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

from conftest import tiny_config
from mlx_diloco.models.zoo import build_model, load_spec
from mlx_diloco.strategies.base import Strategy, default_inner_optimizer
from mlx_diloco.training.workers import Workers, cross_entropy


class Frozen(Strategy):
    """A gradient hook that changes the gradients, as DDP's mean does: the update must use its
    result (zeros: AdamW then moves the weights by their decay alone)."""

    def reduce_gradients(self, grads, step):
        return tree_map(mx.zeros_like, grads)


def train(vectorize, strategy, steps=4, compiled=True):
    """The parameters after `steps` inner steps of 2 replicas of the tiny GPT, clipped (grad_clip is
    small enough to clip), and how many times the loss was traced or run."""
    calls = []

    def counted_loss(model, x, y):
        calls.append(1)
        return cross_entropy(model, x, y)
    config = tiny_config(grad_clip=0.05)
    mx.random.seed(0)
    workers = Workers(build_model(load_spec("tiny"), seed=0), 2, config, default_inner_optimizer(config),
                      vectorize=vectorize, loss=counted_loss, log=lambda m: None)
    rng = np.random.default_rng(0)
    traced = []
    (mx.enable_compile if compiled else mx.disable_compile)()
    try:
        for step in range(1, steps + 1):
            x = mx.array(rng.integers(0, 256, (2, 4, 16)))
            workers.step(x, mx.roll(x, -1, axis=-1), strategy, step)
            traced.append(len(calls))
    finally:
        mx.enable_compile()
    return dict(tree_flatten(workers.params)), traced


def start():
    return {k: p[None] for k, p in tree_flatten(build_model(load_spec("tiny"), seed=0).trainable_parameters())}


@pytest.mark.parametrize("vectorize", [True, False])
@pytest.mark.parametrize("strategy", [Strategy(), Frozen()], ids=["whole-step", "gradient-hook"])
def test_the_compiled_step_is_traced_once_and_trains_as_the_op_by_op_step(vectorize, strategy):
    compiled, traced = train(vectorize, strategy)
    plain, ran = train(vectorize, strategy, compiled=False)
    # traced at the first step (its gradients, measuring the memory the whole step needs), then once
    # as the whole step, and never again
    assert traced[2:] == [traced[1]] * 2 and traced[1] == 2 * traced[0], traced
    assert ran[1:] != [ran[0]] * 3  # (op by op, the loss runs every step)
    for k, p in plain.items():
        np.testing.assert_allclose(np.array(compiled[k]), np.array(p), rtol=1e-4, atol=1e-6, err_msg=k)


def test_a_gradient_hooks_result_is_what_the_update_uses():
    """Given zero gradients by the hook, the weights only decay (lr 1e-3, weight decay 0.1: a
    relative change of about 1e-4 in 4 steps); the model's own gradients move them ~100x more."""
    before = start()
    frozen, _ = train(True, Frozen())
    trained, _ = train(True, Strategy())
    for k, p in before.items():
        np.testing.assert_allclose(np.array(frozen[k]), np.broadcast_to(np.array(p), frozen[k].shape), rtol=1e-3,
                                   err_msg=k)
    assert max(float(mx.abs(trained[k] - p).max()) for k, p in before.items()) > 1e-4


def test_compiled_passes_draw_a_new_dropout_mask_every_call():
    """Dropout (lora-dropout, a model's own) draws from MLX's random state: a compiled function
    that did not take the state in and out would replay its first trace's mask at every step."""
    import mlx.nn as nn
    dropout = nn.Dropout(0.5)

    def dropped_loss(model, x, y):
        return cross_entropy(model, x, y) + dropout(mx.ones(64)).sum() * 1e-3  # its mask shows in the loss
    config = tiny_config()
    workers = Workers(build_model(load_spec("tiny"), seed=0), 2, config, default_inner_optimizer(config),
                      loss=dropped_loss, log=lambda m: None)
    x = mx.array(np.random.default_rng(0).integers(0, 256, (2, 4, 16)))
    y = mx.roll(x, -1, axis=-1)
    grads = [workers._compiled_grads(workers.params, x, y)[0] for _ in range(3)]
    whole = [workers._whole_step(workers.params, workers.optimizer.state, x, y)[0] for _ in range(3)]
    for losses in (grads, whole):
        mx.eval(losses)
        assert len({tuple(np.array(l).round(6)) for l in losses}) == 3, losses


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_update_spread_over_cpu_streams_trains_as_on_one(monkeypatch, precision):
    """On the CPU the optimizer's per-parameter updates run on one MLX stream per thread (their
    kernels each use one core): the same parameters and moments as on one stream, bit for bit, bf16's
    stochastic rounding included."""
    from mlx_diloco.models.precision import to_bf16
    from mlx_diloco.training import workers as stepping
    ends = {}
    for threads in (1, 2):
        monkeypatch.setattr(stepping, "cpu_threads", lambda t=threads: t)
        config = tiny_config(precision=precision)
        mx.random.seed(0)
        model = build_model(load_spec("tiny"), seed=0)
        if precision == "bf16":
            to_bf16(model)
        workers = Workers(model, 2, config, default_inner_optimizer(config), log=lambda m: None)
        assert len(workers.update_streams.streams) == threads
        rng = np.random.default_rng(0)
        for step in range(1, 4):
            x = mx.array(rng.integers(0, 256, (2, 4, 16)))
            workers.step(x, mx.roll(x, -1, axis=-1), Strategy(), step)
        ends[threads] = tree_flatten((workers.params, workers.optimizer.state))
    for (k, a), (_, b) in zip(ends[1], ends[2]):
        assert mx.array_equal(a, b).item(), k
