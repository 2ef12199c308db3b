"""SPARTA + DiLoCo, by composition: a random fraction p of the parameters averaged after every
inner step (SPARTA), and DiLoCo's outer step every H steps. With fraction 0 it is DiLoCo; with
sync-every 0 (no outer steps) it is SPARTA."""

from dataclasses import dataclass

from .base import option
from .diloco import DiLoCo
from .sparta import SPARTA


@dataclass
class SPARTADiLoCo(DiLoCo):
    name = "sparta-diloco"
    steps_can_differ = False  # SPARTA exchanges after every step
    sync_every: int = option(50, "H: inner steps between outer steps (0: none, SPARTA alone)")
    fraction: float = option(0.005, "p: fraction of the parameters averaged after every inner step")
    index_seed: int = option(0, "seed of SPARTA's random indices")

    def check(self):
        self.sparta = SPARTA(fraction=self.fraction, index_seed=self.index_seed)
        self.require(self.sync_every >= 0, f"sync-every must be >= 0 (got {self.sync_every})")
        if self.sync_every:
            super().check()

    def bind(self, comm, steps):
        self.sparta.bind(comm, steps)
        return super().bind(comm, steps)

    def setup(self, params):
        if self.sync_every:
            super().setup(params)

    def reduce_gradients(self, grads, step):
        return super().reduce_gradients(grads, step) if self.sync_every else grads

    def after_step(self, params, step):
        params = self.sparta.after_step(params, step)
        return super().after_step(params, step) if self.sync_every else params

    def global_params(self, params):
        return super().global_params(params) if self.sync_every else self.sparta.global_params(params)

    def state(self):
        return super().state() if self.sync_every else {}

    def load_state(self, state):
        if self.sync_every:
            super().load_state(state)
