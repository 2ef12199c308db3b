"""`--outer-lr auto` and `--outer-momentum auto`: the outer step fitted to the run, from the number
of workers M, the sync period H and the outer steps the run will take, N = (steps - K) / H (each
fragment of Streaming DiLoCo takes N of its own; K: DDP warmup steps).

bench/outer_grid.py measured, at `tiny` against data-parallel at the same tokens, the best outer lr
and Nesterov momentum for M = 1, 4, 8, H = 5 to 100 and N = 11 to 330 (docs/results.md, "Outer
settings that fit the run"). The rule reads that grid: the measured M at or above the run's (past
the largest, the largest), the measured N nearest in log (outside the measured range the nearest
end, and the start line says so). Its numbers are the momentum mu and the momentum-adjusted lr
eta = lr / (1 - mu), what an outer step moves once the momentum is warm (Khaled et al., arXiv
2509.10439); lr = eta (1 - mu). A strategy that fixes its momentum (MuLoCo's 0.6, its authors')
or given one by hand keeps it, and auto's lr keeps the measured eta: lr = eta (1 - that momentum).
"""

import math
from dataclasses import dataclass

from ..options import AUTO

# bench/outer_grid.py (tiny, 20 tokens per parameter and a third and three times that, one seed):
# the best (eta, mu) at each measured M and N, N the outer steps of the run.
MEASURED_N = (11, 55, 165, 330)
BEST = {  # M: ((eta, mu) at each of MEASURED_N)
    1: ((1.0, 0.0), (1.0, 0.0), (1.0, 0.0), (1.0, 0.0)),
    4: ((1.41, 0.5), (1.41, 0.5), (1.41, 0.5), (1.41, 0.5)),
    8: ((1.41, 0.5), (1.41, 0.5), (1.41, 0.5), (1.41, 0.5)),
}
MEASURED_H = (5, 100)
# The eval loss against data-parallel at each cell's best (percent), what a run of that many outer steps costs.
GAP = {
    1: (-0.5, 0.1, -0.25, -0.1),
    4: (7.9, 7.3, 4.8, 4.0),
    8: (10.0, 9.0, 7.0, 6.0),
}


@dataclass(frozen=True)
class OuterChoice:
    """What auto chose for a run, and why: the start line and the run's records say it."""
    lr: float
    momentum: float
    workers: int
    sync_every: int
    outer_steps: float
    measured_at: tuple  # (M, N) of the grid cell it took

    def why(self) -> str:
        M, N = self.measured_at
        line = (f"outer lr {self.lr:g} and momentum {self.momentum:g} by auto: M={self.workers}, H={self.sync_every}, "
                f"{self.outer_steps:.0f} outer steps (measured best at M={M}, {N} outer steps; "
                "strategies/outer_lr.py)")
        outside = []
        if not MEASURED_N[0] / 1.5 <= self.outer_steps <= MEASURED_N[-1] * 1.5:
            outside.append(f"{self.outer_steps:.0f} outer steps")
        if self.workers > max(BEST):
            outside.append(f"M={self.workers}")
        if not MEASURED_H[0] <= self.sync_every <= MEASURED_H[-1]:
            outside.append(f"H={self.sync_every}")
        if outside:
            line += (f"; {' and '.join(outside)} outside the measured range (M {min(BEST)}-{max(BEST)}, "
                     f"H {MEASURED_H[0]}-{MEASURED_H[-1]}, {MEASURED_N[0]}-{MEASURED_N[-1]} outer steps): "
                     "the nearest measured cell's choice")
        return line


def auto_outer(workers: int, sync_every: int, steps: int, warmup_steps: int = 0) -> tuple:
    """(outer lr, momentum) auto gives a run of `steps` inner steps (`warmup_steps` of them DDP)."""
    choice = choose(workers, sync_every, steps, warmup_steps)
    return choice.lr, choice.momentum


def choose(workers: int, sync_every: int, steps: int, warmup_steps: int = 0, momentum=AUTO) -> OuterChoice:
    """The grid's cell for the run and what it gives; a fixed `momentum` keeps the cell's eta."""
    outer_steps = max(steps - warmup_steps, 1) / max(sync_every, 1)  # H 0: sparta-diloco without its outer step
    M = min((m for m in BEST if m >= workers), default=max(BEST))
    i = min(range(len(MEASURED_N)), key=lambda j: abs(math.log(MEASURED_N[j] / max(outer_steps, 1))))
    eta, mu = BEST[M][i]
    mu = mu if momentum == AUTO else momentum
    return OuterChoice(round(eta * (1 - mu), 3), mu, workers, sync_every, outer_steps, (M, MEASURED_N[i]))


def auto_help() -> str:
    """What `auto` gives, for the strategies' --help."""
    return ("outer learning rate, or auto: from M, H and the run's outer steps by the grid bench/outer_grid.py "
            "measured (strategies/outer_lr.py); the start line says what it chose and why")


MOMENTUM_HELP = ("outer momentum (Nesterov's, heavy-ball SGD's, Adam's beta1; 0: plain SGD), or auto: with "
                 "--outer-lr, from M, H and the run's outer steps (strategies/outer_lr.py)")


def check_outer(strategy):
    """Its outer lr's and momentum's ranges: numbers (lr > 0, momentum in [0, 1)) or auto, a rule
    for the momentum optimizers' steps (not for Adam's, which are about the lr per value whatever
    the pseudo-gradient's size)."""
    lr, mu = strategy.outer_lr, strategy.outer_momentum
    strategy.require(lr == AUTO or lr > 0, f"outer-lr must be > 0 or {AUTO} (got {lr})")
    strategy.require(mu == AUTO or 0 <= mu < 1, f"outer-momentum must be in [0, 1) or {AUTO} (got {mu})")
    strategy.require(lr != AUTO or not is_adam(strategy), f"outer-lr {AUTO} is the rule for nesterov and sgd; with "
                     "outer-optimizer adam pass a number near the pseudo-gradients' size, e.g. --outer-lr 0.05")


def is_adam(strategy) -> bool:
    return getattr(strategy, "outer_optimizer", "") == "adam"


ADAM_BETA1 = 0.9  # what momentum auto is for an outer Adam: its usual beta1, as before auto


def auto_fields(strategy) -> list:
    return [k for k in ("outer_lr", "outer_momentum") if getattr(strategy, k, None) == AUTO]


def with_auto_outer(strategy, workers: int, steps: int):
    """(strategy, choice): `strategy` as given and None, or, where its outer lr or momentum is auto, the
    same strategy with the numbers auto gives (a new one: a composite builds its parts from its
    options) and what it chose."""
    if not auto_fields(strategy):
        return strategy, None
    if is_adam(strategy):  # its lr is given (check_outer); its momentum is Adam's beta1
        return type(strategy)(**{**strategy.options(), "outer_momentum": ADAM_BETA1}), None
    choice = choose(workers, strategy.sync_every, steps, getattr(strategy, "ddp_warmup_steps", 0),
                    strategy.outer_momentum)
    given = {k: v for k, v in (("outer_lr", strategy.outer_lr),) if v != AUTO}
    chosen = {"outer_lr": choice.lr, "outer_momentum": choice.momentum, **given}
    return type(strategy)(**{**strategy.options(), **chosen}), choice


def explain(strategy, workers: int, steps: int) -> str:
    """The line that says what auto chooses for `strategy`'s job and why ('' where nothing is auto)."""
    _, choice = with_auto_outer(strategy, workers, steps)
    return choice.why() if choice else ""


# What runs saved before auto trained with, where they left the option to its default: the outer lr
# of diloco, muloco, sparta-diloco and quorum before issue 39, their momentum before issue 44. Those
# runs recorded only the options given; runs since record auto's numbers.
DEFAULT_BEFORE_AUTO = {"outer_lr": 0.7, "outer_momentum": 0.9}


def cell_gap(workers: int, outer_steps: float) -> tuple:
    """(N, gap in percent) of the grid's cell for a run of `outer_steps` at M = `workers`."""
    M = min((m for m in BEST if m >= workers), default=max(BEST))
    i = min(range(len(MEASURED_N)), key=lambda j: abs(math.log(MEASURED_N[j] / max(outer_steps, 1))))
    return MEASURED_N[i], GAP[M][i]


def few_outer_steps(workers: int, sync_every: int, steps: int, budget_h: int) -> str:
    """'' or one line: a run whose outer steps are few for its M (the grid measured at least a point
    more against data-parallel than at the most it measured), what that cost and what would do
    better: `budget_h`, the smallest H that keeps its exchanges within budget, where it is smaller."""
    N, gap = cell_gap(workers, steps / max(sync_every, 1))
    most, least_gap = cell_gap(workers, MEASURED_N[-1])
    if gap - least_gap < 1.0:
        return ""
    line = (f"{steps / max(sync_every, 1):.0f} outer steps are few for M={workers}: the grid measured {gap:+.1f}% "
            f"against data-parallel at ~{N} outer steps, {least_gap:+.1f}% at ~{most}")
    if budget_h < sync_every:
        return line + f"; H={budget_h} keeps the exchanges within budget and takes {steps / budget_h:.0f}"
    return line + "; a longer run, or a smaller payload (--compress int4) for a smaller H, would do better"
