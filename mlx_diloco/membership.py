"""A membership schedule: workers that leave and join mid-run (issue 24), replayed by the simulator
so that the gym can study it without a cluster. MLX-free, like speeds.py.

`--membership "0:4,300:3,600:4"`: from step 0, 4 of the job's --workers slots are members; from
step 300, 3; from step 600, 4 again. The slots are the worker ids 0..W-1, each with its own data
shard, and W is the largest count in the schedule.

- A drop to n at step s: the highest-numbered members leave at s (they take no inner step from s
  on). Their inner steps since their last sync are lost: at the next sync they send weight 0.
- A rise to n at step s: the lowest-numbered free slots join at the first sync point t >= s (a step
  at which a fragment of the model syncs; with one fragment, the outer steps). A joiner's replica
  takes the whole global model and the inner optimizer state of the lowest-numbered member, PEER
  (what a peer sends a joiner on a cluster), and steps from t + 1.
So the members are always slots 0..n-1. At every sync, each slot's pseudo-gradient is weighted by
the inner steps it took in the window the sync covers, since it (last) joined, 0 for a slot that is
not a member then: M n_i / sum n, as speeds.py's sync_weights, so the mean over the M slots is the
token-weighted mean over the members. A fragment that syncs at step t covers the steps since it last
synced; at the run's last step every fragment syncs.
"""

import math
from dataclasses import dataclass

from .options import ConfigError

EXAMPLE = "0:4,300:3,600:4"
PEER = 0  # the member whose inner optimizer state a joiner takes: the lowest-numbered, always a member


@dataclass(frozen=True)
class Schedule:
    counts: tuple  # ((step, members from that step on), ...), steps increasing, the first at step 0

    @classmethod
    def of(cls, config):
        """The config's membership schedule, or None when the membership is fixed."""
        text = config.membership.strip()
        if not text:
            return None
        if config.worker_speeds.strip() or config.speed_policy == "time":
            raise ConfigError("membership cannot be combined with worker-speeds or speed-policy time (each "
                              "decides which workers step); drop --membership or the speeds")
        counts = parse(text)
        if counts[0][0] > 0:  # absent at step 0: every slot is a member from the start
            counts = ((0, config.workers),) + counts
        largest = max(n for _, n in counts)
        if largest != config.workers:
            raise ConfigError(f"membership has at most {largest} members but --workers is {config.workers}; "
                              f"set --workers {largest} (the largest count in the schedule)")
        return cls(counts)


def parse(text: str) -> tuple:
    """'STEP:N,...' -> ((step, n), ...), or one ConfigError line naming what is wrong."""
    counts = []
    for item in text.split(","):
        try:
            step, n = (int(part) for part in item.split(":"))
        except ValueError:
            raise ConfigError(f"membership must be STEP:WORKERS pairs separated by commas, e.g. {EXAMPLE} "
                              f"(got '{item.strip()}' in '{text}')") from None
        if step < 0 or n < 1:
            raise ConfigError(f"membership needs steps >= 0 and at least 1 worker (got '{item.strip()}')")
        if counts and step <= counts[-1][0]:
            raise ConfigError(f"membership steps must increase (got step {step} after step {counts[-1][0]})")
        counts.append((step, n))
    return tuple(counts)


def check_strategy(strategy):
    """A schedule needs a strategy whose workers exchange nothing between syncs (their steps may
    differ), and none of what this simulation leaves out."""
    if not strategy.steps_can_differ:
        raise ConfigError(f"membership needs a strategy that exchanges only at its syncs (diloco, fedavg, muloco; "
                          f"no ddp-warmup-steps), not {strategy.name}; drop --membership")
    if getattr(strategy, "overlap_steps", 0):
        raise ConfigError("membership with overlap-steps is not simulated (a worker could leave with an exchange "
                          "in flight); drop --overlap-steps or --membership")
    if getattr(strategy, "error_feedback", False):
        raise ConfigError("membership with error-feedback is not simulated (a leaver would still send what "
                          "compression lost before it left); drop --error-feedback or --membership")


@dataclass(frozen=True)
class Change:
    """A worker leaving or joining. A leaver takes no inner step from `step` on; a joiner is admitted
    after the sync at `step` and steps from step + 1."""
    step: int
    worker: int
    joined: bool
    members: int         # members after the change
    lost_steps: int = 0  # a leaver's inner steps since `since`, which no sync carries
    since: int = 0       # the oldest of the fragments' last syncs before it left (0: the start)

    @property
    def first_step(self) -> int:
        """The first step the change affects."""
        return self.step + 1 if self.joined else self.step

    def describe(self) -> str:
        members = f"{self.members} worker{'s' if self.members != 1 else ''}"
        if self.joined:
            return f"step {self.step}: worker {self.worker} joined from the global model; {members}"
        steps = f"{self.lost_steps} inner step{'s' if self.lost_steps != 1 else ''}"
        return (f"step {self.step}: worker {self.worker} left (its {steps} since step {self.since} "
                f"{'is' if self.lost_steps == 1 else 'are'} lost); {members}")

    def row(self) -> dict:
        """As the metrics rows list it."""
        out = {"step": self.step, "worker": self.worker, "event": "joined" if self.joined else "left",
               "members": self.members}
        return out if self.joined else {**out, "lost_steps": self.lost_steps, "since": self.since}


class Timeline:
    """Who is a member at each step of a run of `steps` steps whose fragments sync every
    `sync_every` steps at `offsets` (fragment p at the steps t >= 1 with t = offsets[p] mod H)."""

    def __init__(self, schedule: Schedule, sync_every: int, offsets: list, steps: int):
        self.schedule, self.H, self.offsets, self.steps = schedule, sync_every, sorted(set(offsets)), steps
        self.slots = max(n for _, n in schedule.counts)
        self.segments = [(1, schedule.counts[0][1])]  # (first step, members from it on)
        self.changes = []
        self._replay()

    def _replay(self):
        """The schedule's drops at their steps and its rises at the next sync point, in step order."""
        entries = self.schedule.counts
        for k, (step, n) in enumerate(entries[1:], 1):
            until = entries[k + 1][0] if k + 1 < len(entries) else math.inf
            members = self.segments[-1][1]
            if n < members and step <= self.steps:
                since = min(self._last_sync(o, step) for o in self.offsets)
                self.changes += [Change(step, w, False, n, self._stint_steps(w, since, step - 1), since)
                                 for w in reversed(range(n, members))]
                self.segments.append((step, n))
            elif n > members:
                admit = self._next_sync(step)
                if admit < min(until, self.steps):  # else a later entry (or the run's end) comes first
                    self.changes += [Change(admit, w, True, n) for w in range(members, n)]
                    self.segments.append((admit + 1, n))

    def _last_sync(self, offset: int, step: int) -> int:
        """The last step before `step` at which the fragment at `offset` synced (0: the start)."""
        last = step - 1 - (step - 1 - offset) % self.H
        return last if last >= 1 else 0

    def _next_sync(self, step: int) -> int:
        """The first step >= `step` at which a fragment syncs."""
        return min(step + (o - step) % self.H for o in self.offsets)

    def members(self, step: int) -> int:
        """How many slots (0..n-1) take inner step `step`; at step 0, the members at the start."""
        return next(n for first, n in reversed(self.segments) if first <= max(step, 1))

    def _stint_steps(self, worker: int, start: int, step: int) -> int:
        """Inner steps `worker` took in (start, step] since it last joined (0 if it did not take `step`)."""
        if step < 1 or self.members(step) <= worker:
            return 0
        first = step
        for begin, n in reversed(self.segments):
            if begin > step:
                continue
            if n <= worker:
                break
            first = begin
        return step - max(start, first - 1)

    def steps_taken(self, step: int) -> list:
        """Inner steps each slot has taken in steps 1..step."""
        ends = [s for s, _ in self.segments[1:]] + [math.inf]
        return [sum(max(0, min(end, step + 1) - begin) for (begin, n), end in zip(self.segments, ends) if n > w)
                for w in range(self.slots)]

    def _weights(self, offset: int, step: int) -> list:
        """Each slot's factor on what it sends at the sync at `step` of the fragment at `offset`."""
        taken = [self._stint_steps(w, self._last_sync(offset, step), step) for w in range(self.slots)]
        return [self.slots * n / sum(taken) for n in taken]

    def sync_weights(self, step: int):
        """{fragment offset: the factors on each slot's pseudo-gradient} for the fragments that sync
        at `step`, each over its own window (None: no sync then)."""
        syncing = self.offsets if step == self.steps else [o for o in self.offsets if (step - o) % self.H == 0]
        return {o: self._weights(o, step) for o in syncing} or None

    def changes_between(self, start: int, step: int) -> list:
        """The changes at steps in (start, step]."""
        return [c for c in self.changes if start < c.step <= step]

    def lost_steps(self, step: int) -> list:
        """Each slot's inner steps lost by leaving, up to `step`."""
        lost = [0] * self.slots
        for c in self.changes_between(0, step):
            lost[c.worker] += c.lost_steps
        return lost
