"""`--outer-lr auto`: DiLoCo's outer learning rate from the number of workers M and the sync
period H, the rule bench/scaling_table.py measured (docs/results.md, "Table 4 at our scale").

The DiLoCo scaling-law paper (arXiv 2503.09799, Figure 7, Figure 8a) finds the best outer lr
independent of model size, rising with M and with H. At H = 30 we take each M's best outer lr as
measured; away from M = 1, 2, 4, 8 it is interpolated in log2 M (and held past 8, where neither
the paper nor we measured); away from H = 30 it scales as (H / 30) ** H_EXPONENT, fitted to the
best outer lr at H = 50 against H = 30 at M = 4 and 8; the result stays in the swept range.
"""

import math
from dataclasses import fields, replace

from ..options import AUTO

MEASURED_H = 30
# The best outer lr at H = 30 per M (bench/scaling_table.py, tiny at 20 tokens per parameter,
# outer lr swept over 0.2..1.0; the paper's 35M: 0.6 / 0.6 / 0.6 / 1.0).
BEST_AT_H30 = {1: 0.6, 2: 0.6, 4: 0.6, 8: 0.8}
# log(best at H = 50 / best at H = 30) / log(50 / 30) at M = 4 and 8 (bench/scaling_table.py).
H_EXPONENT = 0.5
SWEPT = (0.2, 1.0)  # the range measured: the rule does not extrapolate past it


def auto_outer_lr(workers: int, sync_every: int) -> float:
    """The outer lr `auto` gives for M = `workers` and H = `sync_every`, to two decimals."""
    sizes = sorted(BEST_AT_H30)
    m = min(max(math.log2(max(workers, 1)), math.log2(sizes[0])), math.log2(sizes[-1]))
    below = max(s for s in sizes if math.log2(s) <= m)
    above = min(s for s in sizes if math.log2(s) >= m)
    share = 0.0 if above == below else (m - math.log2(below)) / (math.log2(above) - math.log2(below))
    at_h30 = BEST_AT_H30[below] + share * (BEST_AT_H30[above] - BEST_AT_H30[below])
    return round(min(max(at_h30 * (sync_every / MEASURED_H) ** H_EXPONENT, SWEPT[0]), SWEPT[1]), 2)


def auto_help() -> str:
    """What `auto` gives, for a strategy's --help."""
    at = [(m, h) for h in (MEASURED_H, 50) for m in (2, 4, 8)]
    return (f"outer learning rate, or {AUTO}: from M and H by the rule bench/scaling_table.py measured "
            f"(strategies/outer_lr.py): " + ", ".join(f"M={m} H={h}: {auto_outer_lr(m, h):g}" for m, h in at))


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


def as_it_ran(config):
    """A saved run's config, its outer lr as the run trained with it: one saved before auto that
    left outer-lr to its default trained with DEFAULT_BEFORE_AUTO, and resumes with it."""
    from . import strategy_class  # the registry imports this module
    default = next((f.default for f in fields(strategy_class(config.strategy)) if f.name == "outer_lr"), None)
    if default != AUTO or "outer_lr" in config.strategy_options:
        return config
    return replace(config, strategy_options={**config.strategy_options, "outer_lr": DEFAULT_BEFORE_AUTO})
