"""DES-LOC, Desynced Low Communication adaptive optimizers (arXiv 2505.22549, ICLR 2026).

Every worker runs the inner AdamW on its own data, and the workers average three things, each on
its own period: the parameters x every Kx steps (`sync_every`), AdamW's first moment m every Ku
steps and its second moment v every Kv steps. An average replaces every worker's values with the
mean over the workers (no outer optimizer). The moments change more slowly than the parameters
(their half-lives, ln 0.5 / ln beta: 7 steps for beta1 = 0.9, 14 for beta2 = 0.95, the config's
defaults), so they can be averaged more rarely: the paper recommends Ku = 3 Kx and Kv = 6 Kx, the
defaults (-1). The step count that AdamW's bias correction reads is shared by the workers and left
alone.

This follows the authors' code, github.com/Iacob-Alexandru-Andrei/torchft, torchft/local_sgd.py
(class DESLoc): after the inner step, each quantity whose period has come round since the start
is averaged (step t averages x when t % Kx == 0), in the order parameters, first moment, second
moment. (The paper's Algorithm 1 averages before its step t, counted from 0, when t mod K = 0: the
same schedule, its t = 0 a no-op on replicas that start equal.) Left out of that code: its
optional outer optimizer (a DiLoCo step on the averaged parameters), which the paper's Algorithm 1
does not have. The paper's per-coordinate gradient clipping (rho, for its proofs) is not in that
code either: the run's global-norm clipping (--grad-clip) stays.
The last step averages the parameters whatever the period, so that a run ends synced and the
global model is any worker's.

Local Adam, all three averaged every K steps (the paper's baseline), is DES-LOC with equal periods:

    mlx-diloco sim --strategy desloc --sync-every 50 --first-moment-sync-every 50 --second-moment-sync-every 50

A period of 0 never averages that moment: each worker keeps its own (parameter averaging over
local AdamW states, the heuristic the paper shows oscillating).
"""

from dataclasses import dataclass

from mlx.utils import tree_map

from ..exchange.codecs import get_codec
from ..exchange.worker_axis import placeholders
from ..schedules.schedule import SyncSchedule
from .base import NO_INPUTS, Strategy, TickInputs, default_inner_optimizer, option

# The averaged moments: MLX's AdamW state names, the paper's ratio of each period to Kx, and the
# option that sets it.
MOMENTS = {"m": (3, "first_moment_sync_every", "first moment"),
           "v": (6, "second_moment_sync_every", "second moment")}
# Codecs that keep every value's own exponent. fp16 and the quantized ones scale a whole exchange
# by one unit: second moments span the square of the gradients' range, and the smallest would
# round to 0, where m / sqrt(v) explodes.
CODECS = ("fp32", "bf16")


@dataclass
class DESLOC(Strategy):
    name = "desloc"
    sync_every: int = option(50, "Kx: inner steps between parameter averages")
    first_moment_sync_every: int = option(-1, "Ku: inner steps between averages of AdamW's first moment "
                                              "(-1: 3 Kx, the paper's ratio; 0: never)")
    second_moment_sync_every: int = option(-1, "Kv: inner steps between averages of AdamW's second moment "
                                               "(-1: 6 Kx, the paper's ratio; 0: never)")
    compress: str = option("fp32", f"codec of the averaged values: {' or '.join(CODECS)}")

    def check(self):
        get_codec(self.compress)
        self.require(self.compress in CODECS, f"compress must be {' or '.join(CODECS)} (got '{self.compress}'): "
                     "the others scale an exchange by one unit, which rounds small second moments to 0")
        self.require(self.sync_every >= 1, f"sync-every (Kx) must be >= 1 (got {self.sync_every})")
        for _, key, _ in MOMENTS.values():
            value = getattr(self, key)
            self.require(value >= -1, f"{key.replace('_', '-')} must be a number of steps, 0 (never) "
                                      f"or -1 (the paper's ratio to Kx) (got {value})")

    def period(self, moment: str) -> int:
        """Inner steps between averages of AdamW's moment `moment` ("m" or "v"; 0: never)."""
        ratio, key, _ = MOMENTS[moment]
        value = getattr(self, key)
        return ratio * self.sync_every if value == -1 else value

    @property
    def is_local_adam(self) -> bool:
        return self.period("m") == self.period("v") == self.sync_every

    def label(self) -> str:
        if self.is_local_adam:
            parts = ["local-adam", f"H={self.sync_every}"]
        else:
            parts = [self.name, f"H={self.sync_every}"] + [
                f"K{'uv'[i]}={self.period(m) or 'never'}" for i, m in enumerate(MOMENTS)]
        return " ".join(parts + ([self.compress] if self.compress != "fp32" else []))

    def inner_optimizer(self, config):
        # Kept: the moments to average live in its state (the run steps this very optimizer).
        self.optimizer = default_inner_optimizer(config)
        return self.optimizer

    def setup(self, params):
        self.template = placeholders(params)  # the tree's shape, to find each parameter's moments

    def after_step(self, params, step, tick: TickInputs = NO_INPUTS):
        moments = [(moment, what) for moment, (_, _, what) in MOMENTS.items()
                   if SyncSchedule(self.period(moment)).syncs(step)]
        if self.schedule.syncs(step) or step == self.steps:
            params = self.average(params, "parameters")
        elif moments:  # an exchange of moments alone: a NaN in the weights stops every worker now, not later
            self.comm.check_finite(params, "its parameters")
        for moment, what in moments:
            self.average_moment(moment, what)
        return params

    def average(self, tree, tag: str):
        """Every local worker's values replaced by the mean over all workers, in their own dtypes."""
        mean = self.comm.broadcast_local(self.comm.all_mean(tree, self.compress, tag=tag))
        return tree_map(lambda new, old: new.astype(old.dtype), mean, tree)

    def average_moment(self, moment: str, tag: str):
        """The inner optimizer's moment `moment` averaged over the workers, in its state."""
        state = self.optimizer.state  # {"step", "learning_rate", and each parameter's {"m", "v"}}
        mean = self.average(tree_map(lambda _, s: s[moment], self.template, state), tag)
        self.optimizer.state = {**state, **tree_map(lambda _, s, new: {**s, moment: new}, self.template, state, mean)}
