"""The worker's side of a membership change on an elastic cluster job (cluster/launcher.py: a strategy
whose syncs fall every H steps, so workers may come and go between them). Each change is a new ring
of processes, each resuming from its own saved state, so nobody loses the inner steps they took but
a lost worker:

- the launcher asks a worker to stop through its agent (`StopRequests`): now (a member was lost), or
  at the next sync point (a machine joins there); a planned membership schedule stops the ring
  where it changes;
- a worker saves its own state, without a collective (a peer may be gone), before every step that
  meets its peers (a lost peer there would otherwise cost it its round), written in the background
  while it trains on, where its memory has room for the state it holds meanwhile; and where it
  stops, at once;
- a new ring's workers are brought to one round: joiners, and a worker whose saved state misses a
  sync the others took, take the job's state from a member over the ring.

`Elastic` is built only for a cluster worker's ring (Run.from_job), from the run's parts, and the
run asks it at two seams, as torchft's DiLoCo asks its Manager at start_quorum (who is in the
round, and a joiner's state) and should_commit (whether this worker goes on): `start` (the new
ring brought to one round) and `before_tick` (a stop where one is due; else the save before a step
that meets the peers).
"""

import json
import os
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from ..atomic import atomic_write_text
from ..options import ConfigError
from ..records import PROGRESS, STOP, TIME
from ..run_folder import latest_step
from . import checkpoint
from .checkpoint import in_order_of


class StoppedForChange(Exception):
    """This worker saved its state for a membership change; the launcher starts the job's next ring."""


class StopRequests:
    """What the launcher asks of an elastic cluster worker, in a JSON file its agent writes:
    {"stop": "now"}: save at the end of this step and exit (a member was lost: the others keep their
    steps); {"stop": "at_sync", "after": T}: the same at the first sync point from step T on (a
    machine joins there)."""

    def __init__(self, path):
        self.path = Path(path)

    def asked(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):  # none yet (or being written: read again next step)
            return {}


class Elastic:
    """One cluster worker's part in its job's membership changes, from the run's parts: its job
    (worker_job.WorkerJob: the ring's slots, joiners, the agent's control and progress files), the
    communicator, pacing (the membership timeline), strategy, workers and exchange ledger; `clock`:
    the run's steps done and compute time (clock.py), which a joiner takes from a member; `samplers`:
    each local worker's data cursor, over the shards of `data_slots`; `snapshot()`: the run's state
    as a checkpoint keeps it, (arrays, meta), which it saves in `checkpoint_dir`; `memory_limit`:
    the bytes the run may use (0: no limit)."""

    def __init__(self, job, comm, pacing, strategy, workers, ledger, clock, samplers, data_slots: list,
                 batch_size: int, checkpoint_dir: Path, snapshot, memory_limit: float = 0, log=print):
        self.job, self.comm, self.pacing, self.strategy, self.workers = job, comm, pacing, strategy, workers
        self.ledger, self.clock, self.samplers, self.data_slots = ledger, clock, samplers, data_slots
        self.batch_size, self.checkpoint_dir, self.snapshot, self.log = batch_size, Path(checkpoint_dir), snapshot, log
        self.ring = job.ring_slots                         # the job's slot of each worker of this ring
        self.slots = [self.ring[w] for w in comm.local_workers]
        self.stop_requests = StopRequests(job.control) if job.control else None
        self.memory_limit = memory_limit  # bytes the run may use (0: no limit)
        self.saved_step, self.writer, self.write_failed = None, None, None  # the last local save, being written

    # ------------------------------------------------------------ the seams
    def start(self):
        """As the ring starts, before its first collective: the ring brought to one round (`catch_up`)."""
        self.catch_up(self.job.joiners or [])

    def before_tick(self, meets_peers: bool):
        """Before each of the run's ticks: where the launcher or the schedule asks for it, this worker's
        state saved and the run stopped (StoppedForChange); else, when the tick meets the peers
        (`meets_peers`: an exchange starts or lands, an evaluation or a checkpoint gathers them), this
        worker's state saved first."""
        if not self.stop_requests:
            return
        if why := self.why_stop():
            self.save_local_state(at_once=True)
            self.finish_saves()
            self.report_stop(why)
            raise StoppedForChange(why)
        if meets_peers:
            self.save_local_state()  # a peer lost in the exchange ahead must not cost this worker its round

    # ------------------------------------------------------------ stopping for a change
    def why_stop(self) -> str:
        """Why this worker saves its state and exits after the step it just took, if it does: a change
        the schedule plans, or the launcher's request ('' when it goes on)."""
        t, asked = self.clock.steps, self.stop_requests.asked()
        if self._ring_is_behind(t):
            return f"step {t}: the membership schedule changes the ring"
        if asked.get("stop") == "now":
            return f"step {t}: stopped by the launcher (a member was lost)"
        if asked.get("stop") == "at_sync" and t >= asked["after"] and self.pacing.is_sync_point(t):
            return f"step {t}: stopped by the launcher at a sync point (a machine joins)"
        return ""

    def _ring_is_behind(self, step: int) -> bool:
        """Whether the schedule plans a change the ring does not hold yet: a join admitted at `step`, or
        a leave at the next."""
        return any((c.worker in self.ring) != c.joined for c in self.pacing.ring_changes(step))

    def save_local_state(self, at_once: bool = False):
        """This worker's own state (weights, moments, data cursor, the global model and outer state,
        an exchange in flight) on its own disk, with no collective: a peer may be gone. What it resumes
        from after a membership change, so it keeps the inner steps it took. This machine's next process
        reads it, so it is left to the page cache (not synced to the disk: a process's death does not
        lose it). Written by a thread of its own while the run trains on (the run's step does not wait
        for the disk: bench/cluster_streaming.py), one save at a time, unless `at_once`, or the memory
        limit has no room for the state the save holds meanwhile (the step makes new weights and moments
        beside it), or the strategy's outer state waits in files (offload-outer: read one array at a time).
        On Linux the writing thread runs at the lowest priority: the run's own threads first."""
        step = self.clock.steps
        if step in (self.saved_step, latest_step(self.checkpoint_dir)):
            return
        with self.clock.part(TIME.save_s):
            self.finish_saves()
            arrays, meta = self.snapshot()
            if at_once or self.strategy.offloads_outer or not self._room_for(arrays):
                checkpoint.save(self.checkpoint_dir, step, arrays, meta, durable=False)  # empties `arrays`
            else:
                staged = checkpoint.stage(arrays)
                self.writer = threading.Thread(target=self._write, args=(step, staged, meta), name="local save")
                self.writer.start()
            self.saved_step = step

    def _write(self, step: int, staged: dict, meta: dict):
        if sys.platform == "linux":  # a thread is a task of its own there: the run's threads come first
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        try:
            checkpoint.save(self.checkpoint_dir, step, staged, meta, durable=False)
        except BaseException as e:  # said where the run next waits for it (finish_saves)
            self.write_failed = e

    def finish_saves(self):
        """Wait for the save being written, if any (before another save, a checkpoint, a stop)."""
        if self.writer is not None:
            self.writer.join()
            self.writer = None
        if self.write_failed is not None:
            failed, self.write_failed = self.write_failed, None
            raise failed

    def _room_for(self, arrays: dict) -> bool:
        """Whether the memory limit (none: room) holds the run's peak and the state a save holds."""
        held = sum(v.nbytes for _, v in tree_flatten(arrays))
        return not self.memory_limit or mx.get_peak_memory() + held <= self.memory_limit

    def report_stop(self, why: str):
        """Tell the launcher (through the progress file its agent reads) where this worker stopped and
        who the members are from the next step on."""
        if not self.job.progress:
            return
        path = Path(self.job.progress)
        progress = json.loads(path.read_text()) if path.exists() else {}
        members = self.pacing.member_slots(self.clock.steps + 1)
        stopped = STOP.check({STOP.step: self.clock.steps, STOP.why: why, STOP.members: members,
                              STOP.time: time.time()})
        atomic_write_text(path, json.dumps({**progress, PROGRESS.stopped: stopped}))

    # ------------------------------------------------------------ a new ring
    def catch_up(self, joiners: list):
        """Bring every worker of a new ring to the same round: the joiners, and a worker whose saved
        state is from before a sync that another's includes (it died after that exchange, before its
        checkpoint), take the job's state from a member (`admit`); else the ring would pair its
        exchanges with other ones. Every process of the ring takes part."""
        steps = [int(s) for s in self.comm.gather_metric(mx.full((self.comm.n_local,), self.clock.steps))]
        behind = [slot for slot, step in zip(self.ring, steps)
                  if any(self.pacing.is_sync_point(t) for t in range(step + 1, max(steps) + 1))]
        for slot, step in zip(self.ring, steps):
            if slot in behind and slot not in joiners and slot in self.slots:
                self.log(f"worker {slot}'s state (step {step}) is from before a sync the others took: it takes "
                         "the job's state from a member")
        if behind or joiners:
            self.admit(sorted(set(behind) | set(joiners)))

    def admit(self, joiners: list):
        """Slots joining at this start take, over the ring from the lowest-numbered member (not from
        any disk: the launching Mac may hold nothing), the global model and outer optimizer state,
        that member's inner optimizer state, the step and the run's counters; and their shard's cursor
        where the slot's last worker left it. Every process of the ring takes part."""
        if self.strategy.own_state:
            raise ConfigError(f"a worker cannot join a {self.strategy.name} job whose workers each keep "
                              f"{self.strategy.own_state} of their own; start the job with every worker, or without it")
        peer = self.ring.index(min(set(self.ring) - set(joiners)))
        clock = {"counts": mx.array([self.clock.steps, self.ledger.bytes_sent, self.ledger.peak_bytes], mx.int64),
                 "seconds": mx.array([self.clock.compute_s, self.ledger.comm_s], mx.float32)}
        got = self.comm.broadcast({"strategy": self.strategy.state(), "inner": self.workers.optimizer.state,
                                   "clock": clock}, source=peer)
        if not set(self.slots) & set(joiners):
            return
        sent = sum(v.nbytes for _, v in tree_flatten(got))
        self.strategy.load_state(got["strategy"])
        self.workers.optimizer.state = in_order_of(self.workers.optimizer.state, got["inner"])
        self.workers.admit([True] * self.comm.n_local, self.strategy.global_params(self.workers.params), {})
        self.clock.steps, self.ledger.bytes_sent, self.ledger.peak_bytes = got["clock"]["counts"].tolist()
        self.clock.compute_s, self.ledger.comm_s = got["clock"]["seconds"].tolist()
        taken = self.pacing.steps_taken(self.clock.steps)
        for sampler, slot in zip(self.samplers, self.data_slots):
            sampler.seek(taken[slot] * self.batch_size)
        self.log(f"worker {self.slots[0]} joined at step {self.clock.steps}, from worker {self.ring[peer]}'s state "
                 f"({sent:,} bytes over the ring)")
