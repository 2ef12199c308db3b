"""Which of this process's workers step at each tick: workers of different speeds (speeds.py),
how long a tick counts, and, under speed-policy time on a real cluster (no speeds given), the
speeds measured over the first round; or a membership schedule (membership.py): who is a member,
how each member's pseudo-gradient counts at a sync, and who leaves or joins when. What the
strategy's step needs of it comes as an argument (`inputs_at`: strategies.base.TickInputs)."""

import mlx.core as mx

from ..schedules.membership import Schedule, Timeline
from ..schedules.speeds import Speeds
from ..strategies.base import NO_INPUTS, TickInputs


class Pacing:
    def __init__(self, config, strategy, comm, slots: list, history: str = None, log=print):
        """`strategy`: set up (a membership schedule reads its fragments' sync offsets). `slots`: the
        job's worker ids of this process's workers. `history`: who joined and left so far on an elastic
        cluster, whose ring holds the members only (default: the config's schedule, all it plans)."""
        self.strategy, self.comm, self.log, self.workers, self.slots = strategy, comm, log, config.workers, slots
        self.speeds = Speeds.of(config)  # None: every worker is as fast as the others
        self.planned = self._timeline(Schedule.of(config), strategy, config.steps)  # None: the membership is fixed
        self.timeline = self._timeline(Schedule.from_text(history, config.workers), strategy, config.steps) \
            if history else self.planned
        # Time-paced without given speeds (a real cluster): measured over the first round.
        self.measuring = config.speed_policy == "time" and self.speeds is None and config.workers > 1

    def _time_paced(self) -> bool:
        """Workers take the steps that fit a round (speed-policy time, speeds given or measured)."""
        return bool(self.speeds) and self.speeds.policy == "time"

    @staticmethod
    def _timeline(schedule, strategy, steps: int):
        """A membership schedule over the run's steps and the strategy's sync points (each of its
        fragments syncs every H steps at its offset)."""
        return schedule and Timeline(schedule, strategy.sync_every, list(strategy.schedule.offsets), steps)

    def members(self, tick: int):
        """Which local workers are members of the job at this tick (a membership schedule; tick 0:
        at the start); None when all are."""
        if self.member_count(tick) == self.workers:
            return None
        members = self.timeline.members(tick)
        return [w in members for w in self.slots]

    def member_count(self, tick: int) -> int:
        """How many of the job's workers are members at this tick."""
        return self.timeline.count(tick) if self.timeline else self.workers

    def peer(self, tick: int) -> int:
        """The job's worker whose inner optimizer state a worker admitted at this tick takes."""
        return self.timeline.peer(tick)

    def active(self, tick: int):
        """Which local workers step at this tick; None when all do."""
        if self.timeline:
            return self.members(tick)
        if not self.speeds or self.speeds.policy == "fixed":
            return None
        active = self.speeds.active(tick)
        return [active[w] for w in self.slots]

    def tick_seconds(self, step_s: float) -> float:
        """A tick's modelled duration, for a speed-1 step of `step_s` seconds."""
        return self.speeds.tick_seconds(step_s) if self.speeds else step_s

    def steps_taken(self, ticks: int) -> list:
        """Inner steps each of the job's workers has taken after `ticks` ticks."""
        if self.timeline:
            return self.timeline.steps_taken(ticks)
        return self.speeds.steps_taken(ticks) if self.speeds else [ticks] * self.workers

    def inputs_at(self, tick: int) -> TickInputs:
        """What the strategy's after_step at this tick needs to know of the workers' pace: time-paced,
        each worker's pseudo-gradient weighed by the tokens it processed in a round and the steps
        each has taken; under a membership schedule, a sync at this tick weighs each by the inner
        steps it took in the window the sync covers."""
        if self._time_paced():
            weights = self.speeds.sync_weights(self.strategy.sync_every)  # every worker steps in a round
            return TickInputs([weights[w] for w in self.slots], self.speeds.steps_taken(tick))
        if self.timeline and (weights := self.timeline.sync_weights(tick)) is not None:
            # Factors for a mean over the job's slots; a ring of the members alone averages over fewer.
            ring = self.comm.num_workers / self.timeline.slots
            return TickInputs({offset: [factors[w] * ring for w in self.slots] for offset, factors in weights.items()})
        return NO_INPUTS

    def is_sync_point(self, tick: int) -> bool:
        """Whether a fragment of the model syncs at this tick (where a joiner can be admitted)."""
        return self.strategy.schedule.syncs(tick)

    def exchanges_at(self, tick: int) -> bool:
        """Whether an exchange starts or lands at this tick (every tick, for a strategy that is not periodic)."""
        return self.strategy.schedule.exchanges_at(tick)

    def ring_changes(self, tick: int) -> list:
        """The planned changes that need a new ring after this tick: joins admitted at it, leaves at the next."""
        if not self.planned:
            return []
        joins = [c for c in self.planned.changes_between(tick - 1, tick) if c.joined]
        return joins + [c for c in self.planned.changes_between(tick, tick + 1) if not c.joined]

    def member_slots(self, tick: int) -> list:
        """The job's members at this tick (all slots when the membership is fixed)."""
        return sorted(self.timeline.members(tick)) if self.timeline else list(range(self.workers))

    def changes_between(self, start: int, tick: int) -> list:
        """The workers that leave or join at ticks in (start, tick] (membership.Change)."""
        return self.timeline.changes_between(start, tick) if self.timeline else []

    def lost_steps(self, ticks: int) -> list:
        """Each worker's inner steps lost by leaving, after `ticks` ticks."""
        return self.timeline.lost_steps(ticks) if self.timeline else [0] * self.workers

    def idle_fraction(self) -> float:
        """The workers' mean share of the time spent waiting for slower ones (modelled)."""
        return sum(f := self.speeds.idle_fraction()) / len(f) if self.speeds else 0.0

    def after_tick(self, tick: int, compute_s: float):
        """At the end of the first round, measure the speeds if they are to be measured."""
        if self.measuring and tick == self.strategy.sync_every:
            self._measure(compute_s / tick)

    def _measure(self, step_s: float):
        """Every worker's speed from its mean step time over the first round (all workers
        stepped at every tick so far), the fastest 1; from now on each takes the steps that fit."""
        times = self.comm.gather_metric(mx.full((self.comm.n_local,), step_s))
        H = self.strategy.sync_every
        # In steps of 0.05 (machines within a few percent count as equal), and at least one step a round.
        speeds = tuple(max(round(20 * min(times) / t) / 20, 1 / H) for t in times)
        self.speeds, self.measuring = Speeds(speeds, "time", start=H), False
        self.log(f"measured worker speeds: {', '.join(f'{s:g}' for s in speeds)}; each takes the steps that fit a round")

    def worker_speeds(self):
        """The job's worker speeds, a list (None when all are alike): metrics rows and checkpoints
        record them."""
        return self.speeds and list(self.speeds.speeds)

    def resume_with(self, speeds):
        """A resumed run keeps the speeds it measured before its checkpoint."""
        if self.measuring and speeds:
            self.speeds, self.measuring = Speeds(tuple(speeds), "time", start=self.strategy.sync_every), False
