"""A new strategy in one short file: DiLoCo whose outer optimizer is Adam with its beta2 an option
(the built-in `--outer-optimizer adam` fixes beta2 at 0.99).

DiLoCo already does the work (fragments, the exchange, checkpoints, the final sync); this class
only says what differs: its options and its outer optimizer. Use it from Python,

    from outer_adam import OuterAdam
    Trainer(...).fit(strategy=OuterAdam(sync_every=50), workers=4, steps=500)

or register it for the command line and config files:

    from mlx_diloco.strategies import STRATEGIES
    STRATEGIES[OuterAdam.name] = OuterAdam
"""

from dataclasses import dataclass

import mlx.optimizers as optim

from mlx_diloco.strategies import DiLoCo, option


@dataclass
class OuterAdam(DiLoCo):
    name = "outer-adam"
    outer_lr: float = option(0.05, "outer Adam learning rate")
    outer_beta2: float = option(0.99, "outer Adam beta2")

    def check(self):
        super().check()
        self.require(0 < self.outer_beta2 < 1, f"outer-beta2 must be in (0, 1) (got {self.outer_beta2})")

    def make_outer_optimizer(self):
        # outer_momentum is Adam's beta1 here; bias correction, as the first outer steps are few
        return optim.Adam(learning_rate=self.outer_lr, betas=[self.outer_momentum, self.outer_beta2],
                          bias_correction=True)
