"""Workers of different speeds (an M1 laptop beside an M4 mini), and the two ways to pace them.

Speeds are relative: a worker of speed s takes 1/s of a speed-1 worker's time per inner step. The
job counts in ticks, the steps of the job-wide counter every worker agrees on (a sync happens at a
tick, and the learning-rate schedule follows ticks, so warmup and decay end together for all).

fixed  every worker steps at every tick: a round is H steps for everyone, and the fast workers
       wait for the slowest at each sync. A tick lasts as long as the slowest worker's step.
time   a tick lasts as long as the fastest worker's step, and each worker steps at the ticks its
       speed reaches: relative speed r = s / max(s) steps at tick t when floor(t r) > floor((t-1) r),
       so it takes floor(H r) steps per round of H ticks. Its pseudo-gradient then counts by the
       tokens it processed (`sync_weights`).
"""

import math
from dataclasses import dataclass

from ..options import ConfigError

POLICIES = ("fixed", "time")


@dataclass(frozen=True)
class Speeds:
    speeds: tuple
    policy: str
    start: int = 0  # the tick they apply from: speeds measured over the first round (every worker stepped)

    @classmethod
    def of(cls, config):
        """The config's worker speeds, or None when every worker is as fast as the others."""
        text, policy = config.worker_speeds.strip(), config.speed_policy
        if policy not in POLICIES:
            raise ConfigError(f"speed-policy must be one of {', '.join(POLICIES)} (got '{policy}')")
        if not text:
            return None
        try:
            speeds = tuple(float(s) for s in text.split(","))
        except ValueError:
            raise ConfigError(f"worker-speeds must be numbers separated by commas, e.g. 1,1,0.5 (got '{text}')") from None
        if len(speeds) != config.workers:
            raise ConfigError(f"worker-speeds gives {len(speeds)} speeds for {config.workers} workers; give one per worker")
        if min(speeds) <= 0:
            raise ConfigError(f"worker-speeds must all be > 0 (got '{text}')")
        return cls(speeds, policy)

    @property
    def relative(self) -> list:
        return [s / max(self.speeds) for s in self.speeds]

    def steps_taken(self, tick: int) -> list:
        """Inner steps each worker has taken after `tick` ticks."""
        if self.policy == "fixed" or tick <= self.start:
            return [tick] * len(self.speeds)
        return [self.start + math.floor((tick - self.start) * r + 1e-9) for r in self.relative]

    def active(self, tick: int) -> list:
        """Whether each worker takes an inner step at `tick` (1-based)."""
        return [a > b for a, b in zip(self.steps_taken(tick), self.steps_taken(tick - 1))]

    def tick_seconds(self, step_s: float) -> float:
        """Modelled duration of one tick, for a speed-1 step of `step_s` seconds."""
        return step_s / (min(self.speeds) if self.policy == "fixed" else max(self.speeds))

    def idle_fraction(self) -> list:
        """Each worker's share of the time spent waiting for others (modelled)."""
        busy = [min(self.speeds) / s if self.policy == "fixed" else 1.0 for s in self.speeds]
        return [1 - b for b in busy]

    def sync_weights(self, sync_every: int) -> list:
        """Factor on each worker's pseudo-gradient so that the all-reduce's mean weighs it by the
        tokens it processed in a round (M n_i / sum n): 1 for everyone under the fixed policy."""
        steps = [b - a for a, b in zip(self.steps_taken(self.start), self.steps_taken(self.start + sync_every))]
        return [len(steps) * n / sum(steps) for n in steps]
