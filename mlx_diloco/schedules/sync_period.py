"""Choosing H (`--sync-every auto`, `plan`, the start line of `sim` and `launch`): the smallest sync
period whose exchanges cost at most EXPOSED_BUDGET of the run's wall-clock, for its link, step time
and payload, and the outer steps the run then takes (more outer steps: closer to data-parallel, by
the grid strategies/outer_lr.py reads).

The exchange of a sync is the strategy's payload through the ring on the link (exchange/network.py's
time model: the modelled link in `sim`, the measured one on a cluster). Streaming DiLoCo exchanges a
fragment P times per H steps, each hidden by up to `overlap_steps` of compute. MLX-free.
"""

from dataclasses import dataclass

LADDER = (5, 10, 15, 20, 25, 30, 40, 50, 75, 100, 150, 200, 300, 500, 750, 1000, 2000, 5000)
EXPOSED_BUDGET = 0.05     # of the wall-clock: a sync period that keeps the exchanges below it
# The step time when none is given or measured: the model's FLOPs per step at this share of the
# machine's measured matmul peak (a guess the start line says; --step-time replaces it).
ASSUMED_MFU = 0.15


@dataclass(frozen=True)
class SyncCost:
    """What one sync costs against the compute between syncs."""
    exchange_s: float        # one exchange of what a sync sends (a fragment's, with fragments)
    step_s: float            # one inner step
    fragments: int = 1       # exchanges per H steps
    overlap_steps: int = 0   # inner steps that each exchange runs beside

    def exposed_s(self) -> float:
        """Seconds per H steps the exchanges add to the wall-clock."""
        return self.fragments * max(0.0, self.exchange_s - self.overlap_steps * self.step_s)

    def share(self, H: int) -> float:
        """The exchanges' share of the wall-clock at sync period H."""
        exposed = self.exposed_s()
        return exposed / (H * self.step_s + exposed) if exposed else 0.0


def choose_sync_every(cost: SyncCost, minimum: int = LADDER[0]) -> int:
    """The smallest H of the LADDER (at least `minimum`) whose exchanges stay within EXPOSED_BUDGET
    of the wall-clock (the largest H of the ladder if none does)."""
    fitting = [H for H in LADDER if H >= minimum and cost.share(H) <= EXPOSED_BUDGET]
    return fitting[0] if fitting else LADDER[-1]


def period_line(H: int, steps: int, cost: SyncCost, link: str, step_from: str, chosen: bool) -> str:
    """The start line: H, the exchange's share of the wall-clock and the outer steps it leaves."""
    best = choose_sync_every(cost)
    exposure = ("hidden by the overlapped steps" if not cost.exposed_s() else
                f"{cost.exposed_s():.3g} s exposed per {H * cost.step_s:.3g} s of compute: {cost.share(H):.1%} of "
                "the wall-clock")
    line = (f"H={H}{' (auto)' if chosen else ''}: each sync's exchange takes {cost.exchange_s:.3g} s on {link} at "
            f"{cost.step_s:.3g} s a step ({step_from}), {exposure}; {steps / H:.0f} outer steps in {steps:,} steps")
    if not chosen and best != H:
        line += (f"; H={best} keeps the exchanges within {EXPOSED_BUDGET:.0%} ({steps / best:.0f} outer steps)"
                 if best < H else f"; at H={H} the exchanges take {cost.share(H):.0%}: H={best} keeps them within "
                 f"{EXPOSED_BUDGET:.0%}")
    return line
