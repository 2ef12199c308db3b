"""models/kernels.py: MLX's fused kernels (a GPU's path) and the CPU's op-by-op path compute the same
losses and gradients, for one replica and for vmapped replicas (the fused kernels folding the
replica axis into the batch), in fp32 and bf16. On this CPU MLX's fused functions run their
op-by-op definitions, so what is checked is the folding and the dispatch, which a GPU runs with
its kernels."""

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from conftest import tiny_config
from mlx_diloco.models import kernels
from mlx_diloco.models.kernels import KernelPaths, replica_axis
from mlx_diloco.models.precision import to_bf16
from mlx_diloco.models.zoo import ModelSpec, build_model, load_spec
from mlx_diloco.strategies.base import default_inner_optimizer
from mlx_diloco.training.workers import Workers

LLAMA = ModelSpec("llama", {"type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
                            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                            "rms_norm_eps": 1e-5, "max_position_embeddings": 64, "tie_word_embeddings": False})
TOLERANCE = {"fp32": dict(rtol=2e-4, atol=1e-6), "bf16": dict(rtol=5e-2, atol=2e-3)}


def test_each_device_gets_its_paths():
    assert KernelPaths.for_device(mx.gpu) == KernelPaths("gpu", fused=True, fp32_matmul=False)
    assert KernelPaths.for_device(mx.cpu) == KernelPaths("cpu", fused=False, fp32_matmul=True)
    assert kernels.paths() == KernelPaths.for_device(mx.default_device())  # decided once, from the device


def losses_and_grads(spec, precision, n_local, fused):
    """Every replica's loss and gradients of one step (each replica its own batch), on a path.
    Precision "bf16 in fp32": the bf16 model's weights, computed in fp32 (the reference)."""
    with kernels.chosen(fused=fused):
        model = build_model(spec, seed=1)
        if precision != "fp32":
            model.set_dtype(mx.bfloat16)
        if precision == "bf16":
            to_bf16(model)
        else:
            model.set_dtype(mx.float32)
        config = tiny_config(precision=precision.split()[0])
        workers = Workers(model, n_local, config, default_inner_optimizer(config), log=lambda m: None)
        rng = np.random.default_rng(0)
        tokens = mx.array(rng.integers(0, spec.vocab_size, (n_local, 3, 17)))
        losses, grads = workers._grads(workers.params, tokens[..., :-1], tokens[..., 1:])
        evals = workers._eval_each(workers.params, tokens[0, :, :-1], tokens[0, :, 1:])  # shared batch
        mx.eval(losses, grads, evals)
    return losses, dict(tree_flatten(grads)), evals


@pytest.mark.parametrize("n_local", [1, 3], ids=["one replica", "vmapped"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("spec", [load_spec("tiny"), LLAMA], ids=["gpt", "llama"])
def test_fused_and_unfused_paths_give_the_same_losses_and_gradients(spec, precision, n_local):
    """fp32: the paths agree to float rounding. bf16: each path's gradients are as close to the same
    weights' fp32 gradients as the other's (within 2x and 1% of their norm; bf16 rounds the
    activations, so neither is exact, and single entries can differ where a relu's input rounds to the
    other side of 0)."""
    fused = losses_and_grads(spec, precision, n_local, fused=True)
    plain = losses_and_grads(spec, precision, n_local, fused=False)
    tol = TOLERANCE[precision]
    np.testing.assert_allclose(np.array(fused[0]), np.array(plain[0]), **tol)
    np.testing.assert_allclose(np.array(fused[2]), np.array(plain[2]), **tol)
    exact = losses_and_grads(spec, "bf16 in fp32", n_local, fused=False)[1] if precision == "bf16" else None
    for k, g in plain[1].items():
        a, b = np.array(fused[1][k].astype(mx.float32)), np.array(g.astype(mx.float32))
        if precision == "fp32":
            np.testing.assert_allclose(a, b, rtol=tol["rtol"], atol=tol["atol"] * np.abs(b).max(), err_msg=k)
        else:
            ref = np.array(exact[k])
            error = lambda x: np.linalg.norm(x - ref) / np.linalg.norm(ref)  # noqa: E731
            assert error(a) <= 2 * error(b) + 0.01, (k, error(a), error(b))
    assert not np.allclose(np.array(fused[0])[:1], np.array(fused[0])[-1:]) or n_local == 1  # replicas' own batches


def per_replica(fn, *arrays):
    """fn on each replica's slice, stacked: what a fold must equal."""
    return mx.stack([fn(*(a[i] for a in arrays)) for i in range(arrays[0].shape[0])])


FOLDED_OPS = {
    "attention": (lambda q, k, v: mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal"),
                  [(2, 4, 9, 16), (2, 2, 9, 16), (2, 2, 9, 16)]),
    "layer_norm": (lambda x, w, b: mx.fast.layer_norm(x, w, b, 1e-5), [(2, 5, 32), (32,), (32,)]),
    "rms_norm": (lambda x, w: mx.fast.rms_norm(x, w, 1e-5), [(2, 5, 32), (32,)]),
    "rope": (lambda x: mx.fast.rope(x, 16, traditional=False, base=10000.0, scale=1.0, offset=0), [(2, 4, 9, 16)]),
    "cross_entropy": (lambda logits, t: mx.fast.cross_entropy(logits, t), [(2, 5, 50), None]),
}


@pytest.mark.parametrize("scale", [1e-8, 1.0, 1e4])
@pytest.mark.parametrize("op", FOLDED_OPS)
def test_each_folded_kernel_equals_the_kernel_on_each_replica(op, scale):
    """Under replica_axis, vmapping a fused function folds the replica axis into the batch: its values
    and gradients are those of the kernel on each replica, at the scales users meet."""
    fn, shapes = FOLDED_OPS[op]
    M = 3
    rng = np.random.default_rng(1)
    inputs = [mx.array(rng.integers(0, 50, (M, 2, 5))) if s is None else
              mx.array(rng.standard_normal((M, *s)).astype(np.float32) * (scale if i == 0 else 1))
              for i, s in enumerate(shapes)]
    floating = [i for i, s in enumerate(shapes) if s is not None]

    def summed(*xs):
        return (fn(*xs).astype(mx.float32) * mx.linspace(0.5, 1.5, fn(*xs).size).reshape(fn(*xs).shape)).sum()

    def gradients(f, *xs):  # as a list, also for one argument
        g = mx.grad(f, argnums=floating)(*xs)
        return list(g) if isinstance(g, (list, tuple)) else [g]

    with kernels.chosen(fused=True), replica_axis():
        out = mx.vmap(fn)(*inputs)
        grads = gradients(lambda *xs: mx.vmap(summed)(*xs).sum(), *inputs)
        assert kernels._folded_cross_entropy is not mx.fast.cross_entropy and mx.fast.cross_entropy is kernels.cross_entropy
    assert mx.fast.cross_entropy is kernels.FAST["cross_entropy"]  # restored
    expected = per_replica(fn, *inputs)
    expected_grads = [mx.stack(g) for g in zip(*(gradients(summed, *(a[i] for a in inputs)) for i in range(M)))]
    np.testing.assert_allclose(np.array(out), np.array(expected), rtol=1e-5, atol=1e-6 * max(scale, 1))
    for a, b in zip(grads, expected_grads):
        b = np.array(b)
        np.testing.assert_allclose(np.array(a), b, rtol=1e-4, atol=1e-5 * np.abs(b).max())


def test_a_weight_shared_by_the_replicas_is_not_folded():
    """A norm's weight that is not vmapped (a frozen base under LoRA) scales every replica alike."""
    x, w = mx.random.normal((3, 4, 8)), mx.random.normal((8,))
    with kernels.chosen(fused=True), replica_axis():
        out = mx.vmap(lambda x: mx.fast.rms_norm(x, w, 1e-5))(x)
    np.testing.assert_allclose(np.array(out), np.array(mx.fast.rms_norm(x, w, 1e-5)), rtol=1e-5, atol=1e-6)


def test_the_unfused_path_leaves_mlx_as_it_is():
    with kernels.chosen(fused=False), replica_axis():
        assert mx.fast.scaled_dot_product_attention is kernels.FAST["scaled_dot_product_attention"]


def test_the_run_summary_says_which_paths_ran(tmp_path):
    from mlx_diloco.exchange.comm import SimCommunicator
    from mlx_diloco.training.run import Run
    summary = Run(tiny_config(steps=4), tmp_path / "r", SimCommunicator(2), log=lambda m: None).train()
    assert summary["kernels"] == "cpu: attention and loss through 2**x"
    assert summary["inner_step"] == "vmapped replicas, compiled whole step"


@pytest.mark.parametrize("scale", [1e-8, 1e-3, 1.0, 1e4])
def test_bf16_stochastic_rounding_is_unbiased_at_every_scale(scale):
    """Each value rounds to one of its two bf16 neighbours, up with the probability of its distance
    (200 draws of 4,096 values: each mean within 5.5 standard errors where p is in [0.05, 0.95], their normalized errors
    centred on 0), also at the edges of a binade; draws repeat from a seed, and neighbouring positions round independently."""
    from mlx_diloco.models.precision import round_bf16_stochastically
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(4096) * scale).astype(np.float32)
    edges = np.float32(2.0) ** np.round(np.log2(np.abs(x[:64]))).astype(np.float32)  # powers of two near x
    x[:64], x[64:128] = np.nextafter(edges, np.float32(0)), np.nextafter(edges, np.float32(np.inf))
    rounded = mx.compile(round_bf16_stochastically, inputs=[mx.random.state], outputs=[mx.random.state])
    mx.random.seed(3)
    draws = np.stack([np.array(rounded(mx.array(x)).astype(mx.float32)) for _ in range(200)]).astype(np.float64)
    down = (x.view(np.uint32) & 0xFFFF0000).view(np.float32).astype(np.float64)  # towards 0
    up = ((x.view(np.uint32) & 0xFFFF0000) + 0x10000).view(np.float32).astype(np.float64)
    assert np.all((draws == down) | (draws == up))
    p = (x - down) / (up - down)  # the probability of rounding away from 0
    se = np.abs(up - down) * np.sqrt(p * (1 - p) / 200)
    z = (draws.mean(axis=0) - x) / np.where(se > 0, se, 1)
    normal = (p > 0.05) & (p < 0.95)  # where a count of 200 draws is near normal
    assert np.abs(z[normal]).max() < 5.5 and abs(z.mean()) < 0.1
    mx.random.seed(3)
    assert np.array_equal(np.array(rounded(mx.array(x)).astype(mx.float32)), draws[0])  # repeats
    away = draws == up
    assert abs(np.corrcoef(away[:, ::2].ravel(), away[:, 1::2].ravel())[0, 1]) < 0.1  # independent positions


def compiled_rounding():
    from mlx_diloco.models.precision import round_bf16_stochastically
    return mx.compile(round_bf16_stochastically, inputs=[mx.random.state], outputs=[mx.random.state])


@pytest.mark.parametrize("shape", [(4096,), (64, 64), (4, 16, 64)])
@pytest.mark.parametrize("value", [1 + 0.3 * 2 ** -7, -1e-3])
def test_bf16_rounding_of_a_constant_tensor_is_independent_per_value(shape, value):
    """A tensor of equal values (a norm's weights at 1, a bias at 0 after Adam's first step) rounds
    each value independently: over 400 draws the variance of its rounded mean is independent
    rounding's, p(1-p) ulp**2 / n (within 0.7-1.4x: the estimate's standard deviation is 7%), not
    the n-times larger one of values rounding alike; and neighbouring values, in a row and across
    rows, are uncorrelated."""
    x = mx.full(shape, value, dtype=mx.float32)
    bits = np.float32(value).view(np.uint32)
    down, up = (np.array([bits & 0xFFFF0000, (bits & 0xFFFF0000) + 0x10000], np.uint32).view(np.float32)
                .astype(np.float64))
    ulp, p = abs(up - down), abs(value - down) / abs(up - down)
    rounded = compiled_rounding()
    mx.random.seed(7)
    draws = np.stack([np.array(rounded(x).astype(mx.float32)) for _ in range(400)]).astype(np.float64)
    assert np.all((draws == down) | (draws == up))
    means = draws.reshape(400, -1).mean(axis=1)
    independent = p * (1 - p) * ulp ** 2 / x.size
    assert 0.7 < means.var() / independent < 1.4
    away = (draws == up).reshape(400, -1, shape[-1])
    assert abs(np.corrcoef(away[..., :-1].ravel(), away[..., 1:].ravel())[0, 1]) < 0.05  # along a row
    if away.shape[1] > 1:
        assert abs(np.corrcoef(away[:, :-1].ravel(), away[:, 1:].ravel())[0, 1]) < 0.05  # across rows


def test_bf16_weights_stay_on_course_through_adamw_as_with_independent_rounding():
    """The project's AdamW, compiled as the workers compile it, steps a bf16 tensor of 4,096 values
    that starts constant (0.75) with a constant gradient, each update 0.3 of bf16's step there: each
    value moves down a step with probability 0.3 at each step, so after 100 steps the tensor mean's
    error has independent rounding's spread, sqrt(100 * 0.3 * 0.7 / 4096) steps. Its RMS over 100 runs
    is within 0.75-1.3x of that (the estimate's standard deviation is 7%), and their mean within
    4 standard errors of 0; values rounding alike would give 64x (issue 47)."""
    from mlx_diloco.strategies.base import AdamW
    ulp, n_steps, runs, n = 2.0 ** -8, 100, 100, 64 * 64
    lr = 0.3 * ulp
    errors = []
    for run in range(runs):
        mx.random.seed(run)
        params = {"w": mx.full((64, 64), 0.75, dtype=mx.bfloat16)}
        grads = {"w": mx.ones((64, 64), dtype=mx.bfloat16)}
        opt = AdamW(learning_rate=lr, betas=[0.9, 0.99], eps=1e-8, weight_decay=0.0, bias_correction=True)
        opt.init(params)
        state = opt.state

        def update(params, grads, state, opt=opt):  # as training/workers.py compiles the update
            opt.state = state
            return opt.apply_gradients(grads, params), opt.state
        step = mx.compile(update, inputs=[mx.random.state], outputs=[mx.random.state])
        for _ in range(n_steps):
            params, state = step(params, grads, state)
            mx.eval(params, state)
        errors.append((params["w"].astype(mx.float32).mean().item() - (0.75 - n_steps * lr)) / ulp)
    independent = np.sqrt(n_steps * 0.3 * 0.7 / n)
    assert 0.75 < np.sqrt(np.mean(np.square(errors))) / independent < 1.3
    assert abs(np.mean(errors)) < 4 * independent / np.sqrt(runs)
