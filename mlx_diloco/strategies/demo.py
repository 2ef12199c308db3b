"""DeMo, decoupled momentum optimization (arXiv 2411.19870). It replaces the inner optimizer:

    m <- beta m + g                           each worker's own momentum, never averaged whole
    c <- DCT of m in chunks; keep the top-k coefficients of each chunk by magnitude
    m <- m - IDCT(kept)                       what is sent leaves the momentum
    Q <- IDCT(mean over workers of the kept)  every worker gathers every worker's indices and values
    theta <- theta - lr (sign(Q) + weight_decay theta)

Communication every step, k/chunk of the values (fp16) plus their indices (one byte each).
The run's gradient clipping does not apply: the update is a sign."""

from dataclasses import dataclass

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np

from ..exchange.comm import flatten_workers, unflatten
from .base import Strategy, lr_schedule, option


def dct_matrix(n: int) -> mx.array:
    """The orthonormal DCT-II basis: coefficients = x @ D.T, and back: x = coefficients @ D."""
    k, i = np.arange(n)[:, None], np.arange(n)[None, :]
    D = np.cos(np.pi * (2 * i + 1) * k / (2 * n)) * np.sqrt(2 / n)
    D[0] /= np.sqrt(2)
    return mx.array(D.astype(np.float32))


@dataclass
class DeMo(Strategy):
    name = "demo"
    clip_gradients = False
    beta: float = option(0.999, "decay of each worker's momentum")
    chunk: int = option(64, "values per DCT chunk (at most 256: indices travel as one byte)")
    topk: int = option(32, "DCT coefficients each worker sends per chunk")

    def check(self):
        self.require(0 <= self.beta < 1, f"beta must be in [0, 1) (got {self.beta})")
        self.require(2 <= self.chunk <= 256, f"chunk must be in [2, 256] (got {self.chunk})")
        self.require(1 <= self.topk <= self.chunk, f"topk must be in [1, chunk] (got {self.topk})")

    def inner_optimizer(self, config):
        return optim.SGD(learning_rate=lr_schedule(config), weight_decay=config.weight_decay)

    def setup(self, params):
        self.D = dct_matrix(self.chunk)
        self.momentum = None

    def reduce_gradients(self, grads, step):
        g, shapes = flatten_workers(grads)
        n, L = g.shape
        chunks = -(-L // self.chunk)
        g = mx.pad(g, [(0, 0), (0, chunks * self.chunk - L)]).reshape(n, chunks, self.chunk)
        m = g if self.momentum is None else self.beta * self.momentum + g
        coefficients = m @ self.D.T
        idx = mx.argpartition(-mx.abs(coefficients), kth=self.topk - 1, axis=-1)[..., :self.topk]
        kept = mx.take_along_axis(coefficients, idx, axis=-1)
        self.momentum = m - mx.put_along_axis(mx.zeros_like(coefficients), idx, kept, axis=-1) @ self.D
        got = self.comm.all_gather({"idx": idx.astype(mx.uint8), "values": kept.astype(mx.float16)}, tag="demo")
        dense = mx.put_along_axis(mx.zeros((self.comm.num_workers, chunks, self.chunk)),
                                  got["idx"].astype(mx.int32), got["values"].astype(mx.float32), axis=-1)
        q = (dense.mean(axis=0) @ self.D).reshape(-1)[:L]
        return unflatten(mx.broadcast_to(mx.sign(q)[None], (n, L)), shapes)

    def state(self):
        return {} if self.momentum is None else {"momentum": self.momentum}

    def load_state(self, state):
        self.momentum = state.get("momentum")
