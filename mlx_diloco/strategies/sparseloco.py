"""SparseLoCo (Sarfi et al. 2025, arXiv 2508.15706), as the reference code defines it: Templar's
one-covenant/SparseLoCo, src/tplr/sparseloco.py (class SparseLoCo, the outer optimizer of its
DiLoCo loop; earlier tplr-y/CCLoco, src/tplr/ccloco.py). Every H inner steps, per parameter tensor,
each worker:

    delta <- global - local                      its pseudo-gradient
    e <- beta e + lr delta                       its error-feedback buffer (fp32, never averaged)
    cut e into h x w chunks, h and w the largest divisors of the tensor's sides not above `chunk`
         (a vector: chunks of w); keep the top k = max(1, round(h w topk / chunk^2)) entries of each
         chunk by magnitude (topk of a full chunk: 64 of 64 x 64 = 1.6%)
    quantize the kept values of the tensor to 2 bits: c = v - mean(v), code = clip(round(c / s + 2),
         0, 3) with s = 6 std(c) / 4 (std with n - 1); each code decodes to the mean of the c that
         took it, plus mean(v): the worker sends those 4 means and the shift, float32
    e <- e - what it sent (decoded)

then every worker all-gathers every worker's indices, codes and scales, and each entry of the
tensor becomes the mean of the decoded values over the workers that sent it, 0 where none did
(the reference's scatter_reduce "mean", include_self=False; the paper writes the aggregate as a
plain average over the R workers, which the code computes only where all of them sent an entry).
The outer step is plain SGD, no momentum (the decayed error buffer stands in for DiLoCo's outer
momentum):  global <- global - lr * that mean; every worker then takes the global model. The outer
learning rate scales both the buffer update and the step, as in the reference (lr = 1, its
default, makes that moot). A tensor of more than two dimensions is chunked as the matrix (first
dimension, the rest), which the reference (1-D and 2-D) does not define; the run's last step
always syncs, however short its round. The defaults are the reference's runs: H = 15 and
beta = 0.95 (CCLoco's train.py), outer lr 1, top 64 of 64 x 64, 4 bins over 6 sigmas (Templar's
hparams/hparams.json; its network runs H = 30).

On the wire, per tensor and sync, each worker sends its K = (chunks x k) indices in the smallest
unsigned integer that numbers a chunk's entries (uint16 for 64 x 64; the reference sends int64,
Templar's network 12 bits), its K codes four to a byte, and 5 float32 scales: K (index bytes +
1/4) + 20 bytes. An all-gather is what sparse messages need (each worker's indices differ, so a
ring cannot add them on the way), and it sends (M - 1) payloads: it grows with M, where a dense
ring all-reduce sends 2(M - 1)/M payloads, under two. At the defaults a kept value costs 2 + 1/4
bytes and 1/64 of the values are kept: 0.035 bytes per parameter against DiLoCo's fp16 2, so the
all-gather sends less than the dense ring while (M - 1) 0.035 < 2 (M - 1)/M 2, that is for
M < 2 * 2 / 0.035 = 113.8 workers (227.6 against fp32). The small preset: 40,149 bytes a worker
and sync against fp16's 2,247,424, crossover at M = 112.0. Past it a job would want a sparse
reduce-scatter, which SparseLoCo does not define.

A NaN or an inf in a worker's buffer is put into its scales, so the exchange's check (comm.py)
stops every worker with NonFiniteValues naming it, whichever entries the top-k picked."""

from dataclasses import dataclass

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from .base import NO_INPUTS, Strategy, TickInputs, option
from .demo import as_matrix, index_dtype, largest_divisor, mean_over_senders, scatter

BITS = 2                  # per quantized value: 4 codes a byte
BINS = 2 ** BITS          # the reference's quantization_bins = 4
RANGE_IN_SIGMAS = 6.0     # the reference's quantization_range: the 4 bins span 6 standard deviations
SCALES = 1 + BINS         # float32 scales per tensor: the shift (mean) and each code's value


class Chunks:
    """How one parameter tensor is cut into h x w chunks, for arrays with a leading worker axis:
    (n, *shape) <-> (n, rows/h, cols/w, h*w), and how many entries of each chunk are sent."""

    def __init__(self, shape: tuple, chunk: int, topk: int):
        self.shape = shape
        self.rows, self.cols = as_matrix(shape)
        self.h, self.w = largest_divisor(self.rows, chunk), largest_divisor(self.cols, chunk)
        self.size = self.h * self.w  # entries per chunk
        # The reference keeps the density of a full chunk: topk / chunk^2 of every chunk's entries.
        self.k = min(max(1, round(self.size * topk / chunk ** 2)), self.size)
        self.count = self.rows // self.h * (self.cols // self.w) * self.k  # values a worker sends

    def split(self, x: mx.array) -> mx.array:
        n, h, w = x.shape[0], self.h, self.w
        blocks = x.reshape(n, self.rows // h, h, self.cols // w, w).transpose(0, 1, 3, 2, 4)
        return blocks.reshape(n, self.rows // h, self.cols // w, self.size)

    def join(self, chunks: mx.array) -> mx.array:
        n, h, w = chunks.shape[0], self.h, self.w
        blocks = chunks.reshape(n, self.rows // h, self.cols // w, h, w).transpose(0, 1, 3, 2, 4)
        return blocks.reshape(n, *self.shape)

    def wire_bytes(self) -> int:
        """One worker's message for this tensor: indices, codes four to a byte, float32 scales."""
        return self.count * index_dtype(self.size).size + -(-self.count // 4) + 4 * SCALES


def quantize(values: mx.array):
    """(n, K) float32 -> 2-bit codes (n, K) and scales (n, 1 + BINS): each row's mean, and the mean
    of the centred values that took each code (0 for a code none took): the reference's _quantize."""
    K = values.shape[1]
    shift = values.mean(axis=1, keepdims=True)
    centred = values - shift
    std = mx.sqrt((centred * centred).sum(axis=1, keepdims=True) / (K - 1)) if K > 1 else mx.zeros(shift.shape)
    step = RANGE_IN_SIGMAS * std / BINS
    step = mx.where((step == 0) | ~mx.isfinite(step), 1.0, step)
    codes = mx.clip(mx.round(centred / step + BINS // 2), 0, BINS - 1).astype(mx.uint8)
    took = codes[..., None] == mx.arange(BINS, dtype=mx.uint8)                    # (n, K, BINS)
    sums, counts = mx.where(took, centred[..., None], 0.0).sum(axis=1), took.sum(axis=1)
    means = mx.where(counts > 0, sums / mx.maximum(counts, 1), 0.0)
    return codes, mx.concatenate([shift, means], axis=1)


def dequantize(codes: mx.array, scales: mx.array) -> mx.array:
    """(n, K) codes and (n, 1 + BINS) scales -> the (n, K) float32 values they stand for."""
    return mx.take_along_axis(scales[:, 1:], codes.astype(mx.int32), axis=1) + scales[:, :1]


def pack_codes(codes: mx.array) -> mx.array:
    """(n, K) codes below 4 -> (n, ceil(K / 4)) bytes, the first code in the lowest bits."""
    n, K = codes.shape
    grouped = mx.pad(codes, [(0, 0), (0, -K % 4)]).reshape(n, -1, 4).astype(mx.uint32)
    return (grouped << (mx.arange(4, dtype=mx.uint32) * BITS)).sum(axis=-1).astype(mx.uint8)


def unpack_codes(packed: mx.array, K: int) -> mx.array:
    n = packed.shape[0]
    codes = (packed[..., None].astype(mx.uint32) >> (mx.arange(4, dtype=mx.uint32) * BITS)) & (BINS - 1)
    return codes.reshape(n, -1)[:, :K].astype(mx.uint8)


@dataclass
class SparseLoCo(Strategy):
    name = "sparseloco"
    keeps_global_model = True
    outer_copies = 1  # the global model (fp32)
    worker_copies = 1  # each worker's error-feedback buffer (fp32)
    own_state = "an error-feedback buffer"
    sync_every: int = option(15, "H: inner steps between syncs")
    outer_lr: float = option(1.0, "outer learning rate (also the factor on the pseudo-gradient added to the error buffer)")
    error_decay: float = option(0.95, "beta: decay of each worker's error-feedback buffer at every sync")
    chunk: int = option(64, "largest side of a chunk (each side: the largest divisor not above it)")
    topk: int = option(64, "entries each worker sends per full chunk (chunk^2 entries; smaller chunks: as many pro rata)")

    def check(self):
        self.require(self.sync_every >= 1, f"sync-every (H) must be >= 1 (got {self.sync_every})")
        self.require(self.outer_lr > 0, f"outer-lr must be > 0 (got {self.outer_lr})")
        self.require(0 <= self.error_decay <= 1, f"error-decay must be in [0, 1] (got {self.error_decay})")
        self.require(self.chunk >= 1, f"chunk must be at least 1 (got {self.chunk})")
        self.require(1 <= self.topk <= self.chunk ** 2,
                     f"topk must be in [1, chunk^2] = [1, {self.chunk ** 2}] (got {self.topk})")

    def setup(self, params):
        flat = tree_flatten(params)
        self.chunks = {key: Chunks(p.shape, self.chunk, self.topk) for key, p in flat}
        self.dtypes = {key: p.dtype for key, p in flat}
        self.global_values = {key: p.astype(mx.float32) for key, p in flat}
        self.error = {key: mx.zeros((self.comm.n_local, *p.shape)) for key, p in flat}
        mx.eval(self.global_values, self.error)

    def wire_bytes(self) -> int:
        """One worker's message at a sync, every tensor's (CHECK_BYTES and the (M - 1) hops aside)."""
        return sum(c.wire_bytes() for c in self.chunks.values())

    def after_step(self, params, step, tick: TickInputs = NO_INPUTS):
        if not self.schedule.syncs(step) and step != self.steps:  # a run always ends synced
            return params
        flat = dict(tree_flatten(params))
        del params  # flat holds the only references: each goes as it is replaced
        got = self.comm.all_gather(self.messages(flat), tag="sparseloco")
        n = self.comm.n_local
        for key, chunks in self.chunks.items():
            values = dequantize(unpack_codes(got[f"{key} codes"], chunks.count), got[f"{key} scales"])
            idx = got[f"{key} idx"]
            mean = mean_over_senders(idx, values.reshape(idx.shape), chunks.size)
            self.global_values[key] = self.global_values[key] - self.outer_lr * chunks.join(mean[None])[0]
            mx.eval(self.global_values[key])
            flat[key] = mx.broadcast_to(self.global_values[key].astype(self.dtypes[key]), (n, *chunks.shape))
        return tree_unflatten(list(flat.items()))

    def messages(self, flat: dict) -> dict:
        """Fold each worker's pseudo-gradient into its error buffer and take out of it what this
        sync sends: {"<parameter> idx": (n, rows/h, cols/w, k), "<parameter> codes": (n, ceil(K/4))
        uint8, "<parameter> scales": (n, 1 + BINS) float32}."""
        wire = {}
        for key, chunks in self.chunks.items():
            delta = self.global_values[key][None] - flat[key].astype(mx.float32)
            e = self.error_decay * self.error[key] + self.outer_lr * delta
            blocks = chunks.split(e)
            idx = mx.argpartition(-mx.abs(blocks), kth=chunks.k - 1, axis=-1)[..., :chunks.k]
            n = idx.shape[0]
            codes, scales = quantize(mx.take_along_axis(blocks, idx, axis=-1).reshape(n, -1))
            sent = dequantize(codes, scales).reshape(idx.shape)
            self.error[key] = e - chunks.join(scatter(idx, sent, chunks.size))
            finite = mx.isfinite(e.reshape(n, -1)).all(axis=1, keepdims=True)  # the check reads the scales
            wire[f"{key} idx"] = idx.astype(index_dtype(chunks.size))
            wire[f"{key} codes"] = pack_codes(codes)
            wire[f"{key} scales"] = mx.where(finite, scales, mx.nan)
            mx.eval(self.error[key], *(wire[f"{key} {part}"] for part in ("idx", "codes", "scales")))
        return wire

    def global_params(self, params):
        return tree_unflatten([(k, v.astype(self.dtypes[k])) for k, v in self.global_values.items()])

    def state(self):
        return {"global": tree_unflatten(list(self.global_values.items())),
                "error": tree_unflatten(list(self.error.items()))}

    def load_state(self, state):
        # By path: a checkpoint reads back with its keys sorted.
        saved_global, saved_error = dict(tree_flatten(state["global"])), dict(tree_flatten(state["error"]))
        self.global_values = {k: saved_global[k] for k in self.global_values}
        self.error = {k: saved_error[k] for k in self.error}

    def global_from_state(self, template, saved):
        """The global values a checkpoint holds, in the dtypes of `template`."""
        values = dict(tree_flatten(saved.strategy["global"]))
        return tree_unflatten([(k, values[k].astype(v.dtype)) for k, v in tree_flatten(template)])
