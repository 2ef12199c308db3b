"""DeMo, decoupled momentum optimization (Peng et al. 2024, arXiv 2411.19870), as the reference
code (bloc97/DeMo, demo.py) defines it. It replaces the inner optimizer; per parameter tensor,
every step:

    theta <- theta (1 - lr wd)                   (the inner SGD's weight decay)
    delta <- beta delta + lr g                   each worker's own momentum (fp32), never averaged whole
    c <- 2-D DCT (orthonormal) of every h x w block of delta, where h and w are the largest
         divisors of the tensor's sides not above `chunk`
    keep the top-k of each block's h*w coefficients by magnitude; delta <- delta - IDCT(kept)
    all-gather every worker's indices and values; each coefficient is the mean over the workers
         that sent it (0 where none did)
    theta <- theta - lr sign(IDCT(those means))

A vector is one row (1-D chunks); a tensor of more than two dimensions is treated as the matrix
(first dimension, the rest), which the reference (1-D and 2-D only) does not define.
Communication every step, one message: per block, k values in the parameter's dtype (as the
reference sends them) and k indices in the smallest unsigned integer that holds h*w (the
reference sends int64). The run's gradient clipping does not apply: it clips what
reduce_gradients returns, here a sign. (The reference's OLMo runs clipped each worker's gradient
before DeMo's step; that would need a clip before the exchange, which the run does not have.)"""

import math
from dataclasses import dataclass

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from .base import Strategy, lr_schedule, option


def dct_matrix(n: int) -> mx.array:
    """The orthonormal DCT-II basis: coefficients = D @ x, and back: x = D.T @ coefficients."""
    k, i = np.arange(n)[:, None], np.arange(n)[None, :]
    D = np.cos(np.pi * (2 * i + 1) * k / (2 * n)) * np.sqrt(2 / n)
    D[0] /= np.sqrt(2)
    return mx.array(D.astype(np.float32))


def largest_divisor(n: int, limit: int) -> int:
    """The largest divisor of n not above limit (the reference's block side)."""
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def as_matrix(shape: tuple) -> tuple:
    """(rows, cols) of the matrix a tensor is transformed as: a vector is one row, a tensor of more
    than two dimensions (first dimension, the rest)."""
    if len(shape) < 2:
        return 1, math.prod(shape)
    return shape[0], math.prod(shape[1:])


def index_dtype(count: int):
    """The smallest unsigned integer type that numbers `count` coefficients."""
    return next(t for t in (mx.uint8, mx.uint16, mx.uint32) if count <= 2 ** (8 * t.size))


class Blocks:
    """How one parameter tensor is cut into h x w blocks and transformed, for arrays with a
    leading worker axis: (n, *shape) <-> (n, rows/h, cols/w, h*w) coefficients."""

    def __init__(self, shape: tuple, chunk: int, topk: int):
        self.shape = shape
        self.rows, self.cols = as_matrix(shape)
        self.h, self.w = largest_divisor(self.rows, chunk), largest_divisor(self.cols, chunk)
        self.size = self.h * self.w                 # coefficients per block
        self.k = min(topk, self.size)               # the reference clamps top-k to the block
        self.Dh, self.Dw = dct_matrix(self.h), dct_matrix(self.w)

    def encode(self, x: mx.array) -> mx.array:
        n, h, w = x.shape[0], self.h, self.w
        blocks = x.reshape(n, self.rows // h, h, self.cols // w, w).transpose(0, 1, 3, 2, 4)
        return (self.Dh @ blocks @ self.Dw.T).reshape(n, self.rows // h, self.cols // w, self.size)

    def decode(self, coefficients: mx.array) -> mx.array:
        n, h, w = coefficients.shape[0], self.h, self.w
        blocks = self.Dh.T @ coefficients.reshape(*coefficients.shape[:-1], h, w) @ self.Dw
        return blocks.transpose(0, 1, 3, 2, 4).reshape(n, *self.shape)


def scatter(idx: mx.array, values: mx.array, size: int) -> mx.array:
    """Dense (..., size) coefficients holding `values` at `idx` (distinct per row), zeros elsewhere."""
    zeros = mx.zeros((*idx.shape[:-1], size), mx.float32)
    return mx.put_along_axis(zeros, idx.astype(mx.int32), values.astype(mx.float32), axis=-1)


def mean_over_senders(idx: mx.array, values: mx.array, size: int) -> mx.array:
    """Every worker's (M, ..., k) indices and values -> each coefficient's mean over the workers
    that sent it (the reference's scatter_reduce "mean", include_self=False): (..., size)."""
    total = scatter(idx, values, size).sum(axis=0)
    senders = scatter(idx, mx.ones(values.shape), size).sum(axis=0)
    return total / mx.maximum(senders, 1)


@dataclass
class DeMo(Strategy):
    name = "demo"
    clip_gradients = False
    own_state = "a momentum"
    worker_copies = 1  # each worker's momentum (fp32)
    beta: float = option(0.999, "decay of each worker's momentum")
    chunk: int = option(64, "largest side of a DCT block (each side: the largest divisor not above it)")
    topk: int = option(32, "DCT coefficients each worker sends per block")

    def check(self):
        self.require(0 <= self.beta < 1, f"beta must be in [0, 1) (got {self.beta})")
        self.require(self.chunk >= 1, f"chunk must be at least 1 (got {self.chunk})")
        self.require(self.topk >= 1, f"topk must be at least 1 (got {self.topk})")

    def inner_optimizer(self, config):
        # The momentum adds lr * g: the same schedule, read at the step the SGD update applies.
        self.lr = lr_schedule(config)
        return optim.SGD(learning_rate=self.lr, weight_decay=config.weight_decay)

    def setup(self, params):
        self.blocks = {key: Blocks(p.shape, self.chunk, self.topk) for key, p in tree_flatten(params)}
        self.momentum = None

    def reduce_gradients(self, grads, step):
        got = self.comm.all_gather(self.messages(grads, step), tag="demo")
        return tree_map(lambda q, g: mx.broadcast_to(mx.sign(q), g.shape).astype(g.dtype), self.average(got), grads)

    def messages(self, grads, step: int) -> dict:
        """Fold the gradients into each worker's momentum, and take out of it what this step sends:
        {"<parameter> idx", "<parameter> values": (n_local, rows/h, cols/w, k)}."""
        lr = self.lr(step - 1)  # the optimizer's step count before this update
        old = dict(tree_flatten(self.momentum)) if self.momentum is not None else {}
        momentum, wire = [], {}
        for key, g in tree_flatten(grads):
            blocks = self.blocks[key]
            delta = lr * g.astype(mx.float32) + (self.beta * old[key] if key in old else 0)
            coefficients = blocks.encode(delta)
            idx = mx.argpartition(-mx.abs(coefficients), kth=blocks.k - 1, axis=-1)[..., :blocks.k]
            values = mx.take_along_axis(coefficients, idx, axis=-1).astype(g.dtype)
            momentum.append((key, delta - blocks.decode(scatter(idx, values, blocks.size))))
            wire[f"{key} idx"], wire[f"{key} values"] = idx.astype(index_dtype(blocks.size)), values
        self.momentum = tree_unflatten(momentum)
        return wire

    def average(self, got: dict):
        """Every worker's messages -> the tree of Q, the decoded mean (a leading axis of 1)."""
        return tree_unflatten([(key, b.decode(mean_over_senders(got[f"{key} idx"], got[f"{key} values"], b.size)[None]))
                               for key, b in self.blocks.items()])

    def state(self):
        return {} if self.momentum is None else {"momentum": self.momentum}

    def load_state(self, state):
        self.momentum = state.get("momentum")
