"""SparseLoCo against a float64 port of the reference's outer step (one-covenant/SparseLoCo,
src/tplr/sparseloco.py, class SparseLoCo), written here from the reference code: per tensor, the
error buffer e <- beta e + lr delta, the top k entries of every chunk, their values quantized to
2 bits (4 bins over 6 standard deviations, each bin decoding to the mean of its values), e minus
what was sent, each entry the mean over the workers that sent it, global <- global - lr * that;
the bytes it sends; a NaN naming its worker; and an exact resume."""

import json
import math

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from conftest import assert_same_arrays, resumed_run, tiny_config
from mlx_diloco.exchange.codecs import CHECK_BYTES
from mlx_diloco.exchange.comm import NonFiniteValues, SimCommunicator
from mlx_diloco.strategies import SparseLoCo
from mlx_diloco.training.run import Run
from test_demo import as_matrix, side  # the chunking is DeMo's reference's (its _get_smaller_split)

# ---------------------------------------------------------------- the reference, in float64


def encode(x, chunk):
    """ChunkingTransform.encode: a vector -> (chunks, w); a matrix -> (rows/h, cols/w, h, w)."""
    if x.ndim == 1:
        return x.reshape(-1, side(len(x), chunk))
    (a, b), h, w = x.shape, side(x.shape[0], chunk), side(x.shape[1], chunk)
    return x.reshape(a // h, h, b // w, w).transpose(0, 2, 1, 3)


def decode(c):
    if c.ndim == 2:
        return c.reshape(-1)
    y, x, h, w = c.shape
    return c.transpose(0, 2, 1, 3).reshape(y * h, x * w)


def k_of(chunk_len, topk, chunk):
    """SparseLoCo.step's k: the density of a full chunk, at least 1, at most the chunk."""
    return min(int(max(1, round(chunk_len * topk / chunk ** 2))), chunk_len)


def quantize(val, bins=4, sigmas=6):
    """TopKCompressor._quantize and _dequantize: the decoded values of one tensor's kept values."""
    shift = val.mean()
    centred = val - shift
    std = np.linalg.norm(centred) / math.sqrt(centred.size - 1) if centred.size > 1 else 0.0
    scale = sigmas * std / bins
    scale = 1.0 if scale == 0 or not np.isfinite(scale) else scale
    q = np.clip(np.round(centred / scale + bins // 2), 0, bins - 1).astype(int)
    lookup = np.array([centred[q == b].mean() if (q == b).any() else 0.0 for b in range(bins)])
    return lookup[q] + shift


def compress(c, topk, chunk):
    """TopKCompressor.compress, quantized: each chunk flattened, the top k by magnitude."""
    flat = c.reshape(*c.shape[:-2], -1) if c.ndim == 4 else c
    k = k_of(flat.shape[-1], topk, chunk)
    idx = np.argsort(-np.abs(flat), axis=-1)[..., :k]
    return idx, quantize(np.take_along_axis(flat, idx, axis=-1))


def decompress(idx, values, shape):
    """scatter_reduce(reduce="mean", include_self=False) into zeros: the mean of what was sent there."""
    hot = idx[..., None] == np.arange(np.prod(shape[-2:]) if len(shape) == 4 else shape[-1])
    total, senders = (hot * values[..., None]).sum(axis=-2), hot.sum(axis=-2)
    return np.where(senders > 0, total / np.maximum(senders, 1), 0).reshape(shape)


def reference_step(p, errors, deltas, lr=1.0, beta=0.95, topk=64, chunk=64):
    """SparseLoCo.step for one tensor on M workers that hold the same p: new p, new errors."""
    errors, sent = list(errors), []
    for m, delta in enumerate(deltas):
        errors[m] = beta * errors[m] + lr * as_matrix(delta)
        c = encode(errors[m], chunk)
        idx, values = compress(c, topk, chunk)
        errors[m] = errors[m] - decode(decompress(idx, values, c.shape))
        sent.append((idx, values))
    idx, values = (np.concatenate(parts, axis=-1) for parts in zip(*sent))  # the all-gather
    return p - lr * decode(decompress(idx, values, c.shape)).reshape(p.shape), errors


def reference_bytes(shape, topk=64, chunk=64):
    """One worker's message per tensor and sync: per chunk k indices of the smallest unsigned type
    that numbers its entries, k 2-bit codes (four a byte over the tensor), and 5 float32 scales."""
    rows, cols = as_matrix(np.zeros(shape)).shape if len(shape) > 1 else (1, shape[0])
    h, w = side(rows, chunk), side(cols, chunk)
    values = (rows // h) * (cols // w) * k_of(h * w, topk, chunk)
    index_bytes = 1 if h * w <= 2 ** 8 else 2 if h * w <= 2 ** 16 else 4
    return values * index_bytes + math.ceil(values / 4) + 5 * 4


# ---------------------------------------------------------------- MLX against it

SHAPES = {"square": (64, 64), "wide": (128, 96), "odd": (45, 70), "vector": (130,), "row": (256,),
          "tensor": (8, 3, 3, 4)}
H = 3  # inner steps between syncs: the test calls after_step at steps 3 and 6


def pseudo_gradients(rng, M, scale):
    """Every worker's pseudo-gradient of every tensor at `scale`, or heavy-tailed (Student-t, df=1)."""
    draw = (lambda s: rng.standard_t(1, size=s)) if scale == "cauchy" else (lambda s: scale * rng.normal(size=s))
    return {k: draw((M, *s)) for k, s in SHAPES.items()}


@pytest.mark.parametrize("M", [2, 3, 5, 8])
@pytest.mark.parametrize("scale", [1e-8, 1.0, 1e4, "cauchy"])
def test_two_outer_steps_match_the_reference(M, scale):
    rng = np.random.default_rng(M)
    size = 1.0 if scale == "cauchy" else scale
    global32 = {k: (size * rng.normal(size=s)).astype(np.float32) for k, s in SHAPES.items()}
    strategy = SparseLoCo(sync_every=H).bind(SimCommunicator(M), steps=10 * H)
    strategy.setup({k: mx.array(v) for k, v in global32.items()})
    want = {k: (v.astype(np.float64), [np.zeros(as_matrix(v).shape)] * M) for k, v in global32.items()}
    for step in (H, 2 * H):
        local = {k: (g[None] - d).astype(np.float32) for (k, g), d in zip(global32.items(),
                                                                          pseudo_gradients(rng, M, scale).values())}
        out = strategy.after_step({k: mx.array(v) for k, v in local.items()}, step)
        for k in SHAPES:
            exact = global32[k].astype(np.float64)[None] - local[k]  # the pseudo-gradient of the float32 values
            p, errors = reference_step(want[k][0], want[k][1], list(exact))
            want[k] = (p, errors)
            got = np.array(strategy.global_values[k])
            moved = np.abs(global32[k] - p).max()  # the size of this step's update
            np.testing.assert_allclose(got, p, rtol=1e-5, atol=1e-5 * moved, err_msg=f"global {k} step {step}")
            for m in range(M):
                np.testing.assert_allclose(np.array(out[k][m]), got, rtol=0, atol=0, err_msg=f"worker {m} {k}")
                e = np.array(strategy.error[k][m]).reshape(errors[m].shape)
                np.testing.assert_allclose(e, errors[m], rtol=1e-5, atol=1e-5 * np.abs(errors[m]).max(),
                                           err_msg=f"error buffer {k} worker {m} step {step}")
            global32[k] = got


def test_each_entry_is_averaged_over_its_senders():
    """Two workers, chunks of 2 entries, k = 1: an entry both send is their mean, an entry one sends is
    its value, the others stay 0. Each worker's four values are two pairs, which 2 bits decode exactly."""
    strategy = SparseLoCo(sync_every=1, chunk=2, topk=1).bind(SimCommunicator(2), steps=5)
    strategy.setup({"v": mx.zeros(8)})
    deltas = mx.array([[2.0, 0, 0, 2, -4, 0, -4, 0],    # sends entries 0, 3, 4, 6
                       [4.0, 0, 4, 0, 0, -2, -2, 0]])   # sends entries 0, 2, 5, 6
    strategy.after_step({"v": -deltas}, 1)              # global 0: local = -delta
    np.testing.assert_array_equal(np.array(strategy.global_values["v"]), [-3, 0, -4, -2, 4, 2, 3, 0])


def test_a_64x64_matrix_sends_64_entries_per_sync():
    """The paper's density: 64 of a 64 x 64 chunk's 4096 entries, as uint16 indices and 2-bit codes."""
    strategy = SparseLoCo(sync_every=1).bind(SimCommunicator(3), steps=5)
    strategy.setup({"w": mx.zeros((64, 64))})
    strategy.after_step({"w": mx.ones((3, 64, 64))}, 1)
    record = strategy.comm.drain_records()[0]
    assert record.payload_bytes == 64 * 2 + 64 // 4 + 5 * 4 == reference_bytes((64, 64))
    assert record.sent_bytes == (3 - 1) * (record.payload_bytes + CHECK_BYTES)
    # wide: 4 chunks of 64 x 48, k = 48; odd: 2 of 45 x 35, k = 25; vector: 5 of 26, k = 1; row: 4 of 64,
    # k = 1; tensor: (8, 36), one chunk of 288 (uint16 indices), k = round(4.5) = 4
    assert {k: reference_bytes(s) for k, s in SHAPES.items()} == {
        "square": 164, "wide": 192 * 2 + 48 + 20, "odd": 50 * 2 + 13 + 20, "vector": 5 + 2 + 20,
        "row": 4 + 1 + 20, "tensor": 4 * 2 + 1 + 20}


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_pseudo_gradient_stops_every_worker_naming_it(bad):
    strategy = SparseLoCo(sync_every=1).bind(SimCommunicator(4), steps=5)
    strategy.setup({"w": mx.zeros((64, 64)), "b": mx.zeros(64)})
    local = np.random.default_rng(0).normal(size=(4, 64)).astype(np.float32)
    local[2, 7] = bad  # in a vector whose chunk sends one entry: the top-k need not pick it
    with pytest.raises(NonFiniteValues, match="worker 2 sent") as raised:
        strategy.after_step({"w": mx.ones((4, 64, 64)), "b": mx.array(local)}, 1)
    assert raised.value.workers == [2]


def test_a_run_sends_the_reference_bytes_and_resumes_exactly(tmp_path):
    # H = 4: syncs at 4, 8, 12 and 14; chunks of 32 x 32 (uint16 indices), 256 of their 1024 entries sent
    config = tiny_config(strategy="sparseloco", workers=3, steps=14, eval_every=4, chunk=32, topk=256)
    straight = Run(config, tmp_path / "straight", SimCommunicator(3), log=lambda m: None)
    straight.train()
    shapes = [v.shape[1:] for _, v in tree_flatten(straight.workers.params)]
    payload = sum(reference_bytes(s, topk=256, chunk=32) for s in shapes)
    assert straight.ledger.bytes_sent == 4 * (3 - 1) * (payload + CHECK_BYTES)
    for k, v in tree_flatten(straight.workers.params):  # the run ends synced: every worker holds the global model
        np.testing.assert_array_equal(np.array(v[1]), np.array(v[0]), err_msg=k)

    resumed = resumed_run(config, tmp_path / "split", stop_after=6)
    assert resumed.steps_done == 4
    resumed.train()
    assert_same_arrays(straight.workers.params, resumed.workers.params)
    rows = [json.loads(l) for l in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["eval_loss"] < rows[0]["eval_loss"] - 0.05
