"""The worker's side of a membership change on an elastic cluster job (cluster/launcher.py: a strategy
whose syncs fall every H steps, so workers may come and go between them). Each change is a new ring
of processes, each resuming from its own saved state, so nobody loses the inner steps they took but
a lost worker:

- the launcher asks a worker to stop through its agent (`StopRequests`): now (a member was lost), or
  at the next sync point (a machine joins there); a planned membership schedule stops the ring
  where it changes;
- a worker holds its own state in memory (references, no copy) before every step that meets its
  peers, and writes it to its disk, without a collective (a peer may be gone), only if that step
  fails or the launcher asks it to stop while it waits there: a lost peer costs it nothing, and a
  run with no change writes nothing (a save before each such step cost Streaming DiLoCo a tenth of
  its wall-clock: bench/cluster_streaming.py). Where it stops for a change, it saves at once;
- a new ring's workers are brought to one round: joiners, and a worker whose saved state misses a
  sync the others took, take the job's state from a member over the ring.

`Elastic` is built only for a cluster worker's ring (Run.from_job), from the run's parts, and the
run asks it at two seams, as torchft's DiLoCo asks its Manager at start_quorum (who is in the
round, and a joiner's state) and should_commit (whether this worker goes on): `start` (the new
ring brought to one round) and `tick` (a stop where one is due; the state held around a step that
meets the peers).
"""

import json
import os
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from ..atomic import atomic_write_text
from ..exchange.comm import NonFiniteValues
from ..options import ConfigError
from ..records import PROGRESS, STOP, TIME
from ..run_folder import latest_step
from ..worker_job import STOPPED_FOR_CHANGE
from . import checkpoint
from .checkpoint import in_order_of

WATCH_S = 0.25        # how often a worker waiting on its peers reads the launcher's stop request
TICK_GRACE_S = 1.0    # how long it then lets the step return by itself before stopping where it waits


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
    as a checkpoint keeps it, (arrays, meta), which it saves in `checkpoint_dir` through the run's
    `checkpoints` (checkpoint.Writer: after the run's checkpoint in flight); `memory_limit`: the
    bytes the run may use (0: MLX's limit)."""

    def __init__(self, job, comm, pacing, strategy, workers, ledger, clock, samplers, data_slots: list,
                 batch_size: int, checkpoints, checkpoint_dir: Path, snapshot, memory_limit: float = 0, log=print):
        self.job, self.comm, self.pacing, self.strategy, self.workers = job, comm, pacing, strategy, workers
        self.ledger, self.clock, self.samplers, self.data_slots = ledger, clock, samplers, data_slots
        self.batch_size, self.snapshot, self.log = batch_size, snapshot, log
        self.checkpoints, self.checkpoint_dir = checkpoints, Path(checkpoint_dir)
        self.ring = job.ring_slots                         # the job's slot of each worker of this ring
        self.slots = [self.ring[w] for w in comm.local_workers]
        self.stop_requests = StopRequests(job.control) if job.control else None
        self.memory_limit = memory_limit  # bytes the run may use (0: no limit)
        self.held = None                    # (step, staged arrays, meta) before a tick that meets the peers
        self.lock = threading.Lock()        # one writer of the held state: the run's thread or the watcher
        self.tick_started = threading.Event()

    # ------------------------------------------------------------ the seams
    def start(self):
        """As the ring starts, before its first collective: the ring brought to one round (`catch_up`);
        the watcher of stop requests started."""
        self.catch_up(self.job.joiners or [])
        if self.stop_requests:
            threading.Thread(target=self._watch, name="stop requests", daemon=True).start()

    @contextmanager
    def tick(self, meets_peers: bool):
        """Around each of the run's ticks: where the launcher or the schedule asks for it, this worker's
        state saved and the run stopped before the tick (StoppedForChange). A tick that meets the peers
        (`meets_peers`: an exchange starts or lands, an evaluation or a checkpoint gathers them) may
        never return (a lost peer): this worker's state before it is held, and written only if the
        tick fails or the launcher asks this worker to stop while it waits (`_watch`)."""
        if self.stop_requests and (why := self.why_stop()):
            self.save_local_state()
            self.report_stop(why, self.clock.steps)
            raise StoppedForChange(why)
        if not (meets_peers and self.stop_requests):
            yield
            return
        self.hold()
        try:
            yield
        except (ConfigError, NonFiniteValues):  # the run stops (diverged, bad input): no state to resume from
            raise
        except BaseException:  # a collective failed (a peer is gone), or the worker was stopped
            with self.lock:
                self.write_held()
            raise
        finally:
            with self.lock:  # (while the watcher writes the held state, it holds the lock until it exits)
                self.held = None

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

    def save_local_state(self):
        """This worker's own state (weights, moments, data cursor, the global model and outer state,
        an exchange in flight) on its own disk, now, with no collective: a peer may be gone. What it
        resumes from after a membership change, so it keeps the inner steps it took. This machine's
        next process reads it, so it is left to the page cache (not synced to the disk: a process's
        death does not lose it)."""
        step = self.clock.steps
        with self.clock.part(TIME.save_s):
            self.checkpoints.wait()  # (the run's checkpoint of this step may be in flight)
            if step != latest_step(self.checkpoint_dir):
                arrays, meta = self.snapshot()
                self.checkpoints.save(self.checkpoint_dir, step, arrays, meta, durable=False)  # empties `arrays`

    def hold(self):
        """Before a tick that meets the peers: this worker's state as it is, held in memory (references
        to evaluated arrays, no copy), for `write_held` should the tick not complete. Where the memory
        limit has no room for it beside the new weights and moments the tick makes, or the strategy's
        outer state waits in files (offload-outer), it is saved to the disk at once instead."""
        step = self.clock.steps
        if step == latest_step(self.checkpoint_dir):
            return
        arrays, meta = self.snapshot()
        with self.clock.part(TIME.save_s):
            if self.strategy.offloads_outer or not checkpoint.fits_beside(arrays, self.memory_limit):
                self.checkpoints.save(self.checkpoint_dir, step, arrays, meta, durable=False)
                return
            self.held = (step, checkpoint.stage(arrays), meta)  # (evaluated already: views, no copy)
        self.tick_started.set()

    def write_held(self):
        """The held state on the disk (by the thread that holds `lock`), unless a newer one is there
        (the run's checkpoint in flight written first: none starts while `lock` is held)."""
        self.checkpoints.wait()
        if self.held is not None and self.held[0] > (latest_step(self.checkpoint_dir) or -1):
            step, staged, meta = self.held
            self.checkpoints.save(self.checkpoint_dir, step, staged, meta, durable=False)

    def _watch(self):
        """A thread of its own: when the launcher asks this worker to stop now while a tick that meets
        the peers has not returned (it waits on a lost peer: MLX's ring hangs on a stalled one), the
        held state is written, the stop reported, and the process ends here; the main thread, waiting
        in the collective, cannot."""
        while True:
            self.tick_started.wait()
            self.tick_started.clear()
            while (held := self.held) is not None:
                time.sleep(WATCH_S)
                if self.stop_requests.asked().get("stop") != "now":
                    continue
                time.sleep(TICK_GRACE_S)  # a tick that returns by itself stops at the next one (`tick`)
                with self.lock:
                    if self.held is not held:
                        break
                    self.write_held()
                    step = max(held[0], latest_step(self.checkpoint_dir) or 0)
                    why = f"step {step}: stopped by the launcher while waiting on a lost peer"
                    self.report_stop(why, step)
                    print(why, file=sys.stderr, flush=True)
                    sys.stdout.flush()
                    os._exit(STOPPED_FOR_CHANGE)  # (as training/worker.py ends a worker stopped for a change)

    def report_stop(self, why: str, step: int):
        """Tell the launcher (through the progress file its agent reads) that this worker stopped with
        its state of `step` saved, and who the members are from the next step on."""
        if not self.job.progress:
            return
        path = Path(self.job.progress)
        progress = json.loads(path.read_text()) if path.exists() else {}
        members = self.pacing.member_slots(step + 1)
        stopped = STOP.check({STOP.step: step, STOP.why: why, STOP.members: members,
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
