"""SPARTA + DiLoCo, by composition: a random fraction p of the parameters averaged after every
inner step (SPARTA), and DiLoCo's outer step every H steps. With fraction 0 it is DiLoCo; with
sync-every 0 (no outer steps) it is SPARTA."""

from dataclasses import dataclass

from .base import option
from .composite import ALL, Composite
from .diloco import DiLoCo
from .sparta import SPARTA


@dataclass
class SPARTADiLoCo(Composite):
    name = "sparta-diloco"
    takes = {DiLoCo: ALL, SPARTA: ("fraction", "index_seed")}  # SPARTA's values travel in fp32, its default
    sync_every: int = option(50, "H: inner steps between outer steps (0: none, SPARTA alone)")

    def build(self):
        self.require(self.sync_every >= 0, f"sync-every must be >= 0 (got {self.sync_every})")
        parts = {"sparta": self.part(SPARTA)}  # first: DiLoCo's outer step sees the averaged values
        if self.sync_every:
            parts["diloco"] = self.part(DiLoCo)
        return parts
