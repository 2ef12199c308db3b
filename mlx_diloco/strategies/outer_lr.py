"""`--outer-lr auto` and `--outer-momentum auto`: the outer step fitted to the run, from the number
of workers M, the sync period H and the outer steps the run will take, N = (steps - K) / H (each
fragment of Streaming DiLoCo takes N of its own; K: DDP warmup steps).

bench/outer_grid.py measured, at `tiny` against data-parallel at the same tokens, the outer lr and
Nesterov momentum for M = 1, 4, 8, H = 5 to 100 and N = 11 to 330 (bench/results/outer-grid.json;
docs/results.md, "Outer settings that fit the run"). Its numbers are the momentum mu and the
momentum-adjusted lr eta = lr / (1 - mu), what an outer step moves once the momentum is warm (Khaled
et al., arXiv 2509.10439); lr = eta (1 - mu). What the grid found:
- the paper's mu = 0.9 (fitted to ~350 outer steps) was the worst momentum in every cell (+1.5 to
  +5 points against the best at M = 4 and 8);
- one worker (M = 1): eta 1, mu 0, plain training, within 1.3% of the cell's best everywhere;
- M >= 2 at H >= 30 (from H = 18, nearer 30 than 10 in log): eta 1.41, mu 0.5 (lr 0.71), best or
  within 1% of it in every cell;
- M >= 2 at H <= 10 (to H = 17): that light momentum too once the run is long (150 outer steps or
  more: within 0.8% of the best), the workers' plain average (eta 1, mu 0) in a shorter one, where the
  momentum overshoots (M = 4, H = 5, 110 outer steps: +6.8% against the average; M = 2, H = 10, 55
  outer steps, a cell left out of the first fit: +5.6%).
So the rule reads M, H and, at a small H, N; N also sets what the run is told it costs (GAP).
Checked on cells left out of the fit (M = 2, other H and T) and at another size (`small`, 26x tiny's
parameters, M = 4, H = 30, 55 outer steps: auto's choice the best of the cell, +7.54% against DP
where tiny's same cell gave +7.32%).
The rule reads the grid: the measured M at or above the run's (past the largest, the largest) and the
measured H nearest in log; outside the measured range the nearest end, and the start line says so.
A strategy that fixes its momentum (MuLoCo's 0.6, its authors') or given one by hand keeps it, and
auto's lr keeps the measured eta: lr = eta (1 - that momentum).
"""

import math
from dataclasses import dataclass

from ..options import AUTO

# bench/outer_grid.py (tiny, 20 tokens per parameter and a third and three times that, one seed):
# the best (eta, mu) at each measured M and H; its regret against each cell's best over the 32 cells
# measured (the fit's and the two checks'): mean 0.32%, at most 1.34%.
MEASURED_H = (5, 10, 30, 100)
PLAIN, LIGHT = (1.0, 0.0), (1.41, 0.5)  # the average as it is; a light momentum and a longer step
LONG_RUN = 150  # outer steps from which the light momentum pays at a small H (measured: 110 no, 165 yes)
SHORT_OR_LONG = (PLAIN, LIGHT)  # (a run of fewer than LONG_RUN outer steps, a longer one)
BEST = {  # M: the (eta, mu) at each of MEASURED_H, or SHORT_OR_LONG where the run's length decides
    1: (PLAIN, PLAIN, PLAIN, PLAIN),
    4: (SHORT_OR_LONG, SHORT_OR_LONG, LIGHT, LIGHT),
    8: (SHORT_OR_LONG, SHORT_OR_LONG, LIGHT, LIGHT),
}
MEASURED_N = (11, 55, 165, 330)
# The eval loss against data-parallel at each measured N (percent): the best cell of that many outer
# steps (the mean where two H were measured), what a run of that many outer steps costs.
GAP = {
    1: (-0.1, -0.6, -0.5, -0.1),
    4: (7.9, 7.3, 4.8, 2.9),
    8: (9.4, 8.6, 6.7, 4.8),
}


def nearest(measured: tuple, value: float) -> int:
    """The index of the measured value nearest `value` in log."""
    return min(range(len(measured)), key=lambda j: abs(math.log(measured[j] / max(value, 1))))


def measured_m(workers: int) -> int:
    return min((m for m in BEST if m >= workers), default=max(BEST))


@dataclass(frozen=True)
class OuterChoice:
    """What auto chose for a run, and why: the start line and the run's records say it."""
    lr: float
    momentum: float
    workers: int
    sync_every: int
    outer_steps: float
    measured_at: tuple  # (M, H) of the grid cell it took

    def why(self) -> str:
        M, H = self.measured_at
        line = (f"outer lr {self.lr:g} and momentum {self.momentum:g} by auto: M={self.workers}, H={self.sync_every}, "
                f"{self.outer_steps:.0f} outer steps (measured best at M={M}, H={H}; strategies/outer_lr.py)")
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
    M, i = measured_m(workers), nearest(MEASURED_H, sync_every)
    cell = BEST[M][i]
    eta, mu = cell[outer_steps >= LONG_RUN] if cell is SHORT_OR_LONG else cell
    mu = mu if momentum == AUTO else momentum
    return OuterChoice(round(eta * (1 - mu), 3), mu, workers, sync_every, outer_steps, (M, MEASURED_H[i]))


def auto_help() -> str:
    """What `auto` gives, for the strategies' --help."""
    return ("outer learning rate, or auto: from M, H and the run's outer steps by the grid bench/outer_grid.py "
            "measured (strategies/outer_lr.py; 1 with momentum 0 for one worker, or H 17 or less and fewer than "
            f"{LONG_RUN} outer steps; else 0.71 with 0.5); "
            "the start line says what it chose and why")


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
    i = nearest(MEASURED_N, outer_steps)
    return MEASURED_N[i], GAP[measured_m(workers)][i]


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
