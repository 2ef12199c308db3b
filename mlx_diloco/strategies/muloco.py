"""MuLoCo (arXiv 2505.23725): DiLoCo whose inner steps use Muon for the transformer blocks' weight
matrices and AdamW for the rest (embeddings, head, norms, biases).

Its outer Nesterov momentum is 0.6, not DiLoCo's 0.9: the MuLoCo authors' default
(github.com/bentherien/muloco-1, `MuLoCo1(outer_momentum=0.6)`, beside 0.9 for DiLoCo). Muon's
steps are large (lr 0.02 on orthogonalized updates): on gpt-wifi-8 the first mean pseudo-gradient
was 10x the last, and momentum 0.9 kept carrying the early ones after the workers had reached the
noise, so the global model's eval went up and down between outer steps (issue 39: 5.699, 5.970,
4.864, 4.790, 4.938, where the plain average of the workers was at 4.547 before the last step;
docs/results.md has the run at 0.6).
"""

from dataclasses import dataclass

import mlx.core as mx
import mlx.optimizers as optim

from .base import default_inner_optimizer, lr_schedule, option
from .diloco import DiLoCo
from .fragments import BLOCK


class ReplicaMuon(optim.Muon):
    """Muon on parameters stacked on a leading replica axis: each replica's matrix is
    orthogonalized on its own (mlx's Muon would flatten the stack into one matrix)."""

    def _zeropower_via_newtonschulz5(self, X, steps: int):
        a, b, c = 3.4445, -4.7750, 2.0315   # Keller Jordan's quintic coefficients
        tall = X.shape[-2] > X.shape[-1]
        if tall:
            X = X.swapaxes(-1, -2)
        X = X / (mx.linalg.norm(X, axis=(-2, -1), keepdims=True) + 1e-7)
        for _ in range(steps):
            A = X @ X.swapaxes(-1, -2)
            X = a * X + (b * A + c * (A @ A)) @ X
        return X.swapaxes(-1, -2) if tall else X

    def apply_single(self, gradient, parameter, state):
        if self.weight_decay != 0:
            gradient = gradient + self.weight_decay * parameter
        state["v"] = self.momentum * state["v"] + (1 - self.momentum) * gradient
        update = gradient * (1 - self.momentum) + state["v"] * self.momentum if self.nesterov else state["v"]
        update = self._zeropower_via_newtonschulz5(update, self.ns_steps)
        scale = max(1, update.shape[-2] / update.shape[-1]) ** 0.5
        return parameter - self.learning_rate.astype(gradient.dtype) * scale * update


def is_block_matrix(path: str, parameter) -> bool:
    """A 2-D weight of a transformer block (3-D here: the replica axis comes first)."""
    return parameter.ndim == 3 and path.endswith("weight") and BLOCK.search(path) is not None


@dataclass
class MuLoCo(DiLoCo):
    name = "muloco"
    outer_momentum: float = option(0.6, "outer momentum, below diloco's 0.9, on which Muon's large steps made "
                                        "the global model swing (strategies/muloco.py)")
    muon_lr: float = option(0.02, "peak learning rate of Muon (AdamW keeps --lr)")
    muon_momentum: float = option(0.95, "Muon's momentum")

    def check(self):
        super().check()
        self.require(self.muon_lr > 0, f"muon-lr must be > 0 (got {self.muon_lr})")

    def check_model(self, spec, adapted_blocks=None):
        super().check_model(spec, adapted_blocks)
        self.require(adapted_blocks is None, "Muon steps the blocks' weight matrices, which lora/dora freeze (the "
                     "adapters would all take AdamW: plain diloco); use --strategy diloco")

    def inner_optimizer(self, config):
        muon = ReplicaMuon(lr_schedule(config, self.muon_lr), momentum=self.muon_momentum,
                           weight_decay=config.weight_decay)
        return optim.MultiOptimizer([muon, default_inner_optimizer(config)], [is_block_matrix])
