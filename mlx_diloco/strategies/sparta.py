"""SPARTA (EXO, 2025): after every inner step the workers average a random fraction p of the
parameters. The indices come from a seed and the step, which every worker shares, so only the
values travel. With p = 1 and inner SGD it is data-parallel SGD."""

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..exchange.codecs import get_codec
from ..exchange.worker_axis import flatten_workers, unflatten
from .base import NO_INPUTS, Strategy, TickInputs, codec_label, option


@dataclass
class SPARTA(Strategy):
    name = "sparta"
    fraction: float = option(0.005, "p: fraction of the parameters averaged after every inner step")
    index_seed: int = option(0, "seed of the random indices (every worker draws the same ones)")
    compress: str = option("fp32", "codec of the averaged parameter values")

    def check(self):
        get_codec(self.compress)
        self.require(0 <= self.fraction <= 1, f"fraction must be in [0, 1] (got {self.fraction})")


    def label_options(self) -> list:
        return super().label_options() + codec_label(self.compress)
    def indices(self, size: int, step: int) -> mx.array:
        if self.fraction >= 1:
            return mx.arange(size)
        # Without replacement: exactly round(p * size) distinct parameters (at least one), sorted
        # so that the gather reads memory in order.
        rng = np.random.default_rng([self.index_seed, step])
        count = max(1, round(self.fraction * size))
        return mx.array(np.sort(rng.choice(size, count, replace=False, shuffle=False)))

    def after_step(self, params, step, tick: TickInputs = NO_INPUTS):
        if self.fraction == 0:
            return params
        flat, shapes = flatten_workers(params)
        idx = self.indices(flat.shape[1], step)
        mean = self.comm.start_mean(flat[:, idx], self.compress, tag="sparta").result()
        flat[:, idx] = mx.broadcast_to(mean[None], (flat.shape[0], idx.size))
        return unflatten(flat, shapes)
