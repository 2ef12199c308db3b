"""A membership schedule: workers that leave and join mid-run (issue 24), replayed by the simulator
so that the gym can study it without a cluster, or recorded by a cluster as it happened. MLX-free,
like speeds.py.

`--membership "0:4,300:3,600:4"`: from step 0, 4 of the job's --workers slots are members; from
step 300, 3; from step 600, 4 again. `--membership "0:4,120:-1,300:+1"` names the slots: slot 1
leaves at step 120 and joins again at step 300. The slots are the worker ids 0..W-1, each with its
own data shard. Until the first entry every slot is a member. W is the largest count in a schedule
of counts only; a schedule that names slots needs W above every slot it names and at least every
count.

The entries apply in order (steps never decrease; entries at one step apply one after another):
- STEP:N, a count: a drop to N makes the highest-numbered members leave, a rise to N makes the
  lowest-numbered free slots join.
- STEP:-S: slot S leaves at STEP: it takes no inner step from STEP on. Its inner steps since its last
  sync are lost: at the next sync it sends weight 0.
- STEP:+S: slot S joins at the first sync point t >= STEP (a step at which a fragment of the model
  syncs; with one fragment, the outer steps), as does a slot that a rise brings. A joiner's replica
  takes the whole global model and the inner optimizer state of the lowest-numbered member at t, its
  peer (what a peer sends a joiner on a cluster), and steps from t + 1. A joiner that leaves before
  it is admitted never joins.
At every sync, each slot's pseudo-gradient is weighted by the inner steps it took in the window the
sync covers, since it (last) joined, 0 for a slot that is not a member then: M n_i / sum n, as
speeds.py's sync_weights, so the mean over the M slots is the token-weighted mean over the members.
A fragment that syncs at step t covers the steps since it last synced; at the run's last step every
fragment syncs.
"""

import math
from dataclasses import dataclass, field
from typing import NamedTuple

from ..options import ConfigError
from .schedule import SyncSchedule

EXAMPLE = "0:4,300:3,600:4"


class Slot(NamedTuple):
    """An entry that names a slot: it leaves (-S) or joins (+S)."""
    slot: int
    joins: bool

    def __str__(self):
        return f"{'+' if self.joins else '-'}{self.slot}"


class Move(NamedTuple):
    """The slots that leave at `step`, or that join at the first sync point from `step` on."""
    step: int
    slots: tuple  # as their changes are listed: leavers highest-numbered first, joiners lowest first
    joins: bool


@dataclass(frozen=True)
class Schedule:
    entries: tuple       # ((step, a member count or a Slot), ...) in order, steps non-decreasing
    workers: int = None  # W, the slots 0..W-1 (None: the largest count)
    start: frozenset = field(init=False)  # the members at step 0, after the entries at step 0
    moves: tuple = field(init=False)      # each later entry's Move, or none where it changes nothing

    def __post_init__(self):
        """Resolve the entries into slots, or raise one ConfigError line naming a misused one."""
        if self.workers is None:
            object.__setattr__(self, "workers", max(n for _, n in self.entries))
        _check_workers(self.entries, self.workers)
        members = frozenset(range(self.workers))  # every slot, until the first entry
        start, moves = members, []
        for step, what in self.entries:
            move = _move(step, what, members, self.workers)
            members = members.symmetric_difference(move.slots)  # leavers are members, joiners are not
            if not members:
                raise ConfigError(f"membership leaves no worker at step {step} (got '{step}:{what}'); "
                                  f"keep at least 1 worker")
            if step == 0:
                start = members
            elif move.slots:
                moves.append(move)
        object.__setattr__(self, "start", start)
        object.__setattr__(self, "moves", tuple(moves))

    @classmethod
    def of(cls, config):
        """The config's membership schedule, or None when the membership is fixed."""
        text = config.membership.strip()
        if not text:
            return None
        if config.worker_speeds.strip() or config.speed_policy == "time":
            raise ConfigError("membership cannot be combined with worker-speeds or speed-policy time (each "
                              "decides which workers step); drop --membership or the speeds")
        return cls.from_text(text, config.workers)

    @classmethod
    def from_text(cls, text: str, workers: int):
        """The schedule `text` over the slots 0..workers-1 (what a cluster recorded, say)."""
        entries = parse(text)
        if entries[0][0] > 0:  # absent at step 0: every slot is a member from the start
            entries = ((0, workers),) + entries
        return cls(entries, workers)

    @property
    def text(self) -> str:
        """The schedule as `parse` reads it."""
        return ",".join(f"{step}:{what}" for step, what in self.entries)


def parse(text: str) -> tuple:
    """'STEP:N,STEP:-S,STEP:+S,...' -> ((step, n or Slot(S, joins)), ...), or one ConfigError line
    naming what is wrong."""
    entries = []
    for item in text.split(","):
        try:
            step, what = item.split(":")
            step, what = int(step), what.strip()
            named = what[:1] in ("+", "-") and what[1:].isdigit()  # else a count
            what = Slot(int(what[1:]), what[0] == "+") if named else int(what)
        except ValueError:
            raise ConfigError(f"membership must be STEP:WORKERS pairs separated by commas, or STEP:-SLOT and "
                              f"STEP:+SLOT for a slot leaving and joining, e.g. {EXAMPLE} "
                              f"(got '{item.strip()}' in '{text}')") from None
        if step < 0 or (not isinstance(what, Slot) and what < 1):
            raise ConfigError(f"membership needs steps >= 0 and at least 1 worker (got '{item.strip()}')")
        if entries and step < entries[-1][0]:
            raise ConfigError(f"membership steps must not decrease (got step {step} after step {entries[-1][0]})")
        entries.append((step, what))
    return tuple(entries)


def _check_workers(entries: tuple, workers: int):
    """W is the largest count in a schedule of counts only; else above every slot named and at
    least every count."""
    counts = [n for _, n in entries if not isinstance(n, Slot)]
    largest = max(counts, default=0)
    if len(counts) == len(entries) and largest != workers:
        raise ConfigError(f"membership has at most {largest} members but --workers is {workers}; "
                          f"set --workers {largest} (the largest count in the schedule)")
    if largest > workers:
        raise ConfigError(f"membership has up to {largest} members but --workers is {workers}; "
                          f"set --workers {largest} or more")
    slots = [what.slot for _, what in entries if isinstance(what, Slot)]
    if slots and max(slots) >= workers:
        raise ConfigError(f"membership names slot {max(slots)} but --workers is {workers} (slots 0.."
                          f"{workers - 1}); set --workers {max(slots) + 1} or more")


def _move(step: int, what, members: frozenset, workers: int) -> Move:
    """The slots that entry `step:what` makes leave or join, when `members` are (or are to be) the
    members before it."""
    if isinstance(what, Slot):
        if what.joins and what.slot in members:
            raise ConfigError(f"membership: slot {what.slot} joins at step {step} but is a member then or "
                              f"joining already (got '{step}:{what}'); drop it or make the slot leave first")
        if not what.joins and what.slot not in members:
            raise ConfigError(f"membership: slot {what.slot} leaves at step {step} but is not a member then "
                              f"(got '{step}:{what}'); drop it or make the slot join first")
        return Move(step, (what.slot,), what.joins)
    if what < len(members):
        return Move(step, tuple(sorted(members, reverse=True)[:len(members) - what]), False)
    free = sorted(set(range(workers)) - members)
    return Move(step, tuple(free[:what - len(members)]), True)


def check_strategy(strategy):
    """A schedule needs a strategy whose workers exchange nothing between syncs (their steps may
    differ), and none of what this simulation leaves out."""
    if not strategy.steps_can_differ:
        raise ConfigError(f"membership needs a strategy that exchanges only at its syncs (diloco, fedavg, muloco; "
                          f"no ddp-warmup-steps), not {strategy.name}; drop --membership")
    if not strategy.syncs_every_h:
        raise ConfigError(f"membership needs syncs every H steps, which {strategy.name} has not (its outer steps "
                          "come when workers report); drop --membership")
    if strategy.own_state:
        raise ConfigError(f"membership is not simulated with {strategy.own_state} kept by each worker (a leaver "
                          f"would take it away, a joiner has none); drop --membership, or the option that keeps it")


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
        self.sync = SyncSchedule(sync_every, tuple(self.offsets))
        self.slots = schedule.workers
        self.segments = [(1, schedule.start)]  # (first step, the members from it on)
        self.changes = []
        self._replay()

    def _replay(self):
        """The schedule's leavers at their steps and its joiners at the next sync point, in step order."""
        waiting = []  # (sync point, slot): the joiners not admitted yet
        for move in self.schedule.moves:
            waiting = self._admit(waiting, before=move.step)
            if move.joins:
                admit = self._next_sync(move.step)
                if admit < self.steps:  # else the run ends first
                    waiting += [(admit, w) for w in move.slots]
            else:
                waiting = [(t, w) for t, w in waiting if w not in move.slots]  # they leave before they join
                self._leave(move.step, [w for w in move.slots if w in self.segments[-1][1]])
        self._admit(waiting, before=math.inf)

    def _admit(self, waiting: list, before: float) -> list:
        """Admit the joiners waiting for a sync point before step `before`; the others wait on."""
        for admit in sorted({t for t, _ in waiting if t < before}):
            joining = [w for t, w in waiting if t == admit]
            members = self.segments[-1][1].union(joining)
            self.changes += [Change(admit, w, True, len(members)) for w in joining]
            self.segments.append((admit + 1, members))
        return [(t, w) for t, w in waiting if t >= before]

    def _leave(self, step: int, leaving: list):
        """Members `leaving` take no inner step from `step` on."""
        if not leaving or step > self.steps:
            return
        members = self.segments[-1][1].difference(leaving)
        if not members:
            raise ConfigError(f"membership leaves no worker at step {step} (a joiner is admitted only at a "
                              f"sync point); keep a member until then")
        since = min(self._last_sync(o, step) for o in self.offsets)
        self.changes += [Change(step, w, False, len(members), self._stint_steps(w, since, step - 1), since)
                         for w in leaving]
        self.segments.append((step, members))

    def _last_sync(self, offset: int, step: int) -> int:
        """The last step before `step` at which the fragment at `offset` synced (0: the start)."""
        return self.sync.last_sync(offset, step)

    def _next_sync(self, step: int) -> int:
        """The first step >= `step` at which a fragment syncs."""
        return self.sync.next_sync(step)

    def members(self, step: int) -> frozenset:
        """The slots that take inner step `step`; at step 0, the members at the start."""
        return next(members for first, members in reversed(self.segments) if first <= max(step, 1))

    def count(self, step: int) -> int:
        """How many slots take inner step `step`."""
        return len(self.members(step))

    def peer(self, step: int) -> int:
        """The member whose inner optimizer state a slot admitted after the sync at `step` takes: the
        lowest-numbered of those that took step `step`."""
        return min(self.members(step))

    def _stint_steps(self, worker: int, start: int, step: int) -> int:
        """Inner steps `worker` took in (start, step] since it last joined (0 if it did not take `step`)."""
        if step < 1 or worker not in self.members(step):
            return 0
        first = step
        for begin, members in reversed(self.segments):
            if begin > step:
                continue
            if worker not in members:
                break
            first = begin
        return step - max(start, first - 1)

    def steps_taken(self, step: int) -> list:
        """Inner steps each slot has taken in steps 1..step."""
        ends = [s for s, _ in self.segments[1:]] + [math.inf]
        return [sum(max(0, min(end, step + 1) - begin) for (begin, members), end in zip(self.segments, ends)
                    if w in members)
                for w in range(self.slots)]

    def _weights(self, offset: int, step: int) -> list:
        """Each slot's factor on what it sends at the sync at `step` of the fragment at `offset`."""
        taken = [self._stint_steps(w, self._last_sync(offset, step), step) for w in range(self.slots)]
        return [self.slots * n / sum(taken) for n in taken]

    def sync_weights(self, step: int):
        """{fragment offset: the factors on each slot's pseudo-gradient} for the fragments that sync
        at `step`, each over its own window (None: no sync then)."""
        syncing = self.offsets if step == self.steps else [o for o in self.offsets if self.sync.syncs(step, o)]
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
