"""`--outer-lr auto`: DiLoCo's outer learning rate from the number of workers M and the sync
period H, by the rule bench/scaling_table.py measured (docs/results.md, "Table 4 at our scale").

The DiLoCo scaling-law paper (arXiv 2503.09799, Figures 7 and 8a) finds the best outer lr
independent of model size, and rising with M and with H: at 35M, 0.6 / 0.6 / 0.6 / 1.0 for
M = 1 / 2 / 4 / 8 at H = 30. The rule keeps that form (a non-decreasing table by M at H = 30, a
power of H / 30) with the values fitted to our measurements; a worker count between the measured
ones takes the next measured M up, one past 8 takes 8's (neither the paper nor we measured more),
and the result stays in the swept range.
"""

from ..options import AUTO

MEASURED_H = 30
# bench/scaling_table.py (tiny at 20 tokens per parameter, Nesterov 0.9, H = 30) measured the best
# outer lr 0.6 / 0.4 / 0.6 / 0.6 at M = 1 / 2 / 4 / 8, each an interior optimum of the paper's grid
# {0.2, ..., 1.0}. Non-decreasing in M, as the paper's trend, the fit is 0.6 throughout: at M = 2
# it costs 0.5% eval loss against 0.4 (3.7230 vs 3.7032), where 0.4 at M = 1 would cost 0.7%.
BEST_AT_H30 = {1: 0.6, 2: 0.6, 4: 0.6, 8: 0.6}
# The best at H = 50 (M = 4: 0.6 of 0.4 / 0.6 / 0.8) is H = 30's: no rise with H measured here.
H_EXPONENT = 0.0
SWEPT = (0.2, 1.0)  # the range measured: the rule does not extrapolate past it


def auto_outer_lr(workers: int, sync_every: int) -> float:
    """The outer lr `auto` gives for M = `workers` and H = `sync_every`, to two decimals."""
    M = min((m for m in BEST_AT_H30 if m >= workers), default=max(BEST_AT_H30))
    return round(min(max(BEST_AT_H30[M] * (sync_every / MEASURED_H) ** H_EXPONENT, SWEPT[0]), SWEPT[1]), 2)


def auto_help() -> str:
    """What `auto` gives, for a strategy's --help."""
    at = ", ".join(f"M={m}: {auto_outer_lr(m, MEASURED_H):g}" for m in BEST_AT_H30)
    return (f"outer learning rate, or {AUTO}: from M and H by the rule bench/scaling_table.py measured "
            f"(strategies/outer_lr.py): {at} at H = {MEASURED_H}, times (H/{MEASURED_H})**{H_EXPONENT:g}")


def check_outer_lr(strategy):
    """Its outer-lr's range: a number > 0, or auto, a rule for the momentum optimizers' steps (not
    for Adam's, which are about the lr per value whatever the pseudo-gradient's size)."""
    lr = strategy.outer_lr
    strategy.require(lr == AUTO or lr > 0, f"outer-lr must be > 0 or {AUTO} (got {lr})")
    strategy.require(lr != AUTO or getattr(strategy, "outer_optimizer", "") != "adam",
                     f"outer-lr {AUTO} is the rule for nesterov and sgd; with outer-optimizer adam pass a number "
                     "near the pseudo-gradients' size, e.g. --outer-lr 0.05")


def with_outer_lr(strategy, workers: int):
    """`strategy`, or where its outer-lr is 'auto' the same strategy with the number auto gives for
    `workers` (a new one: a composite builds its parts from its options)."""
    if getattr(strategy, "outer_lr", None) != AUTO:
        return strategy
    return type(strategy)(**{**strategy.options(), "outer_lr": auto_outer_lr(workers, strategy.sync_every)})


# The outer lr of diloco, muloco, sparta-diloco and quorum before auto (issue 39). Their runs
# recorded only the options given; the runs started since record auto's number.
DEFAULT_BEFORE_AUTO = 0.7
