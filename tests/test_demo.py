"""DeMo (issue 20, item 4) against a float64 port of the reference step (bloc97/DeMo, demo.py),
written here from the reference code: per tensor, 2-D DCT blocks, top-k per block, each coefficient
averaged over the workers that sent it, momentum delta <- beta delta + lr g, theta <- theta(1 - lr wd)
- lr sign(Q); and the bytes it sends."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from scipy.fft import dct, idct

from conftest import assert_same_arrays, resumed_run, tiny_config
from mlx_diloco.exchange.comm import SimCommunicator
from mlx_diloco.exchange.worker_axis import stack_copies
from mlx_diloco.strategies import DeMo
from mlx_diloco.training.run import Run

# ---------------------------------------------------------------- the reference, in float64


def side(n, chunk):
    """The reference's _get_smaller_split: the divisor of n closest to chunk from below."""
    return [d for d in range(1, n + 1) if n % d == 0 and d <= chunk][-1]


def as_matrix(x):
    """The reference transforms 1-D and 2-D tensors; more dimensions: (first, rest), our choice."""
    return x.reshape(x.shape[0], -1) if x.ndim > 2 else x


def encode(x, chunk):
    """TransformDCT.encode: a vector -> (chunks, w); a matrix -> (rows/h, cols/w, h, w) blocks."""
    if x.ndim == 1:
        return dct(x.reshape(-1, side(len(x), chunk)), norm="ortho", axis=-1)
    (a, b), h, w = x.shape, side(x.shape[0], chunk), side(x.shape[1], chunk)
    blocks = x.reshape(a // h, h, b // w, w).transpose(0, 2, 1, 3)
    return dct(dct(blocks, norm="ortho", axis=-2), norm="ortho", axis=-1)


def decode(c):
    if c.ndim == 2:
        return idct(c, norm="ortho", axis=-1).reshape(-1)
    y, x, h, w = c.shape
    return idct(idct(c, norm="ortho", axis=-1), norm="ortho", axis=-2).transpose(0, 2, 1, 3).reshape(y * h, x * w)


def compress(c, topk):
    """CompressDCT.compress: each block's coefficients flattened, the top-k by magnitude."""
    flat = c.reshape(*c.shape[:-2], -1) if c.ndim == 4 else c
    idx = np.argsort(-np.abs(flat), axis=-1)[..., :min(topk, flat.shape[-1])]
    return idx, np.take_along_axis(flat, idx, axis=-1)


def decompress(idx, values, shape):
    """scatter_reduce(reduce="mean", include_self=False) into zeros: the mean of what was sent there."""
    hot = idx[..., None] == np.arange(np.prod(shape[-2:]) if len(shape) == 4 else shape[-1])
    total, senders = (hot * values[..., None]).sum(axis=-2), hot.sum(axis=-2)
    return np.where(senders > 0, total / np.maximum(senders, 1), 0).reshape(shape)


def reference_step(p, deltas, grads, lr, wd, beta=0.999, chunk=64, topk=32):
    """DeMo.step for one tensor on M workers (they hold the same p): new p, new deltas, Q."""
    p, deltas, sent = p * (1 - lr * wd), list(deltas), []
    for m, g in enumerate(grads):
        deltas[m] = beta * deltas[m] + lr * as_matrix(g)
        c = encode(deltas[m], chunk)
        idx, values = compress(c, topk)
        deltas[m] = deltas[m] - decode(decompress(idx, values, c.shape))
        sent.append((idx, values))
    idx, values = (np.concatenate(parts, axis=-1) for parts in zip(*sent))  # the all-gather
    q = decode(decompress(idx, values, c.shape)).reshape(p.shape)
    return p - lr * np.sign(q), deltas, q


def reference_bytes(shape, chunk=64, topk=32, value_bytes=4):
    """One worker's message per step: per block, k values and k indices of the smallest unsigned
    type that numbers the block's coefficients (the reference's int64 indices, made small)."""
    rows, cols = as_matrix(np.zeros(shape)).shape if len(shape) > 1 else (1, shape[0])
    h, w = side(rows, chunk), side(cols, chunk)
    index_bytes = 1 if h * w <= 2 ** 8 else 2 if h * w <= 2 ** 16 else 4
    return (rows // h) * (cols // w) * min(topk, h * w) * (value_bytes + index_bytes)


# ---------------------------------------------------------------- MLX against it

SHAPES = {"square": (64, 64), "wide": (64, 96), "odd": (45, 70), "vector": (130,), "tensor": (8, 3, 3, 4)}
CONFIG = tiny_config(strategy="demo", lr=0.05, warmup=0, steps=10, weight_decay=0.1)


def demo_on(M, topk, params):
    strategy = DeMo(topk=topk).bind(SimCommunicator(M), CONFIG.steps)
    optimizer = strategy.inner_optimizer(CONFIG)
    strategy.setup(params)
    return strategy, optimizer


def reference_run(p0, grads, topk):
    """Each step's (parameters, every worker's momentum, Q) of every tensor, from the reference."""
    state, out = {k: (p, [np.zeros_like(as_matrix(p))] * len(grads[0][k])) for k, p in p0.items()}, []
    for step, g in enumerate(grads, start=1):
        lr = 0.05 * (1 + np.cos(np.pi * (step - 1) / 10)) / 2 * 0.9 + 0.005  # CONFIG's: cosine to a tenth
        out.append({})
        for k in p0:
            p, deltas, q = reference_step(*state[k], list(g[k]), lr, wd=0.1, topk=topk)
            state[k], out[-1][k] = (p, deltas), (p, deltas, q)
    return out


@pytest.mark.parametrize("M", [2, 3, 4])
@pytest.mark.parametrize("topk", [32, 5])
def test_two_steps_match_the_reference(M, topk):
    rng = np.random.default_rng(M * 100 + topk)
    p0 = {k: rng.normal(size=s) for k, s in SHAPES.items()}
    grads = [{k: rng.normal(size=(M, *s)) for k, s in SHAPES.items()} for _ in range(2)]
    want = reference_run(p0, grads, topk)
    params = {k: mx.array(v.astype(np.float32)) for k, v in p0.items()}
    grads = [{k: mx.array(v.astype(np.float32)) for k, v in g.items()} for g in grads]

    # The update, through reduce_gradients and the inner SGD: every worker's parameters.
    strategy, optimizer = demo_on(M, topk, params)
    local = stack_copies(params, M)
    for step, g in enumerate(grads, start=1):
        local = optimizer.apply_gradients(strategy.reduce_gradients(g, step), local)
        for k, (p, _, q) in want[step - 1].items():
            clear = np.abs(q) > 1e-4 * np.abs(q).max()  # where float32 cannot flip the sign
            assert clear.mean() > 0.99, k
            for m in range(M):
                np.testing.assert_allclose(np.array(local[k][m])[clear], p[clear], rtol=1e-5, atol=1e-6,
                                           err_msg=f"parameters {k} worker {m} step {step}")

    # Q before its sign, and every worker's momentum, from the strategy's two halves.
    strategy, _ = demo_on(M, topk, params)
    for step, g in enumerate(grads, start=1):
        q = strategy.average(strategy.comm.all_gather(strategy.messages(g, step)))
        momentum = dict(tree_flatten(strategy.state()))
        for k, (_, deltas, q_ref) in want[step - 1].items():
            np.testing.assert_allclose(np.array(q[k][0]), q_ref, rtol=1e-4, atol=1e-5 * np.abs(q_ref).max(),
                                       err_msg=f"Q {k} step {step}")
            for m in range(M):
                np.testing.assert_allclose(np.array(momentum[f"momentum.{k}"][m]).reshape(deltas[m].shape),
                                           deltas[m], rtol=1e-4, atol=1e-6,  # lr g is about 0.1
                                           err_msg=f"momentum {k} worker {m} step {step}")


def test_each_coefficient_is_averaged_over_its_senders():
    """Two workers, one chunk of 4: a coefficient both send is their mean; one only one sends is its value."""
    strategy, _ = demo_on(2, 2, {"v": mx.zeros(4)})
    got = {"v idx": mx.array([[0, 1], [1, 2]], mx.uint8).reshape(2, 1, 1, 2),  # (workers, rows, chunks, k)
           "v values": mx.array([[1.0, 2.0], [4.0, 8.0]]).reshape(2, 1, 1, 2)}
    want = decode(np.array([[1.0, 3.0, 8.0, 0.0]]))
    np.testing.assert_allclose(np.array(strategy.average(got)["v"][0]), want, rtol=1e-5)


def test_a_64x64_matrix_sends_k_coefficients_per_step():
    """The issue's example: at k = 32 one 64x64 block sends 32 fp32 values and 32 two-byte indices."""
    strategy, _ = demo_on(2, 32, {"w": mx.zeros((64, 64))})
    strategy.reduce_gradients({"w": mx.ones((2, 64, 64))}, step=1)
    assert strategy.comm.drain_records()[0].payload_bytes == 32 * (4 + 2)
    assert {k: reference_bytes(s) for k, s in SHAPES.items()} == \
        {"square": 192, "wide": 2 * 192, "odd": 2 * 192, "vector": 5 * 26 * 5, "tensor": 32 * 6}


def test_a_run_sends_the_reference_bytes_and_resumes_exactly(tmp_path):
    from mlx_diloco.exchange.codecs import CHECK_BYTES  # each exchange's finite-values check
    config = tiny_config(strategy="demo", workers=3, steps=12, eval_every=4)
    straight = Run(config, tmp_path / "straight", SimCommunicator(3), log=lambda m: None)
    straight.train()
    shapes = [v.shape[1:] for _, v in tree_flatten(straight.workers.params)]
    assert straight.ledger.bytes_sent == 12 * (3 - 1) * (sum(reference_bytes(s) for s in shapes) + CHECK_BYTES)

    resumed = resumed_run(config, tmp_path / "split", stop_after=6)
    assert resumed.steps_done == 4
    resumed.train()
    assert_same_arrays(straight.workers.params, resumed.workers.params)
    rows = [json.loads(l) for l in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["eval_loss"] < rows[0]["eval_loss"] - 0.05
