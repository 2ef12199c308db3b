"""A cluster job's life after its start (`mlx-diloco launch`): a state machine over typed events.

The launcher (launcher.py) sets the job up and starts its ring; the supervisor watches it, polling
every agent twice a second (the heartbeat), and each poll ends in one of these events:

    Finished            every worker trained every step
    Lost(who, why)      the ring failed: a worker exited, stalled or its agent stopped answering
                        (`who`: the slots whose machines no longer answer; empty when all do)
    StoppedForChange    every worker saved its state for a membership change (`states`: where each
                        stopped, records.STOP)
    Joined(member)      a machine that may join answers (a lost one, one named with --add, one new
                        on mDNS): the ring stops at its next sync point to admit it

and each event has its handler: a failure restarts the ring (an elastic job's workers each from their
own saved state, the lost machines' slots leaving or waited for; another job's from the newest
checkpoint every worker holds), a stop for a change starts the ring of the new members (a joiner
takes the job's state from a member over the ring: training/elastic.py). The job's summary, at the
end, is records.SUMMARY's, like sim's. The supervisor imports the launcher, never the reverse.
"""

import queue
import sys
import threading
import time
from dataclasses import dataclass, field

from tqdm import tqdm

from ..records import EVENT, PROGRESS, ROW, STOP, TIME, run_summary
from ..training.metrics import human_bytes
from ..machine.utilisation import process_start
from ..worker_job import STOPPED_FOR_CHANGE
from . import protocol
from .discovery import AgentError, watch
from .job_files import JobStatus, Mirror
from .launcher import RESTARTS, JobFailed, Launcher, Member, grid_of, offered_memory


@dataclass(frozen=True)
class Finished:
    """Every worker trained every step."""


@dataclass(frozen=True)
class Lost:
    """The ring failed: `who`, the slots whose machines no longer answer (empty: every machine answers);
    `why`, what failed, in words."""
    who: tuple = ()
    why: str = ""


@dataclass(frozen=True)
class StoppedForChange:
    """Every worker saved its state for a membership change: {slot: where it stopped (records.STOP)}."""
    states: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Joined:
    """A machine that may join the job answers (it holds a free slot now)."""
    member: Member


class Heartbeat:
    """A running ring's agents, polled: each member's state and new output (RUN/logs), rank 0's metrics
    and exchanges mirrored, and what went wrong, if anything."""

    def __init__(self, launcher: Launcher, mirror: Mirror):
        self.launcher, self.state, self.options, self.mirror = launcher, launcher.state, launcher.options, mirror

    def poll(self, m: Member, metrics_from: int, exchanges_from: int = protocol.NO_LOG) -> dict:
        """One heartbeat: the worker's state, rank 0's new metrics and exchanges lines, and the worker's
        new output, appended to RUN/logs/worker-K.log (whose size says how much has been copied)."""
        log = self.launcher.run_dir / "logs" / f"worker-{m.worker_id}.log"
        have = log.stat().st_size if log.exists() else 0
        status = self.launcher.client(m).request("status", job=self.state.job, metrics_from=metrics_from,
                                                 exchanges_from=exchanges_from, log_from=have)
        with open(log, "ab") as f:
            f.write(status.get("log", b""))
        return status

    def failure(self, states: dict):
        """What went wrong (Lost), if anything. When one worker dies its peers fail right after it (their
        ring collective raises), so the likely cause is named: a signal death or a stall before a watchdog
        exit, a watchdog exit before a plain error exit."""
        now, found = time.time(), []  # (rank of the cause, description)
        for m in self.state.members:
            s = states.get(m.worker_id)
            if s is None:
                continue
            who = f"worker {m.worker_id} ({m.host})"
            p = s.get("progress")
            if s["state"] == "unknown":
                found.append((1, f"the agent of {who} no longer knows the job"))
            elif s["state"] == "exited" and s["returncode"] == STOPPED_FOR_CHANGE:
                continue  # saved its state for a membership change: the others follow
            elif s["state"] == "exited" and s["returncode"] < 0:
                found.append((0, f"{who} failed: it was killed by signal {-s['returncode']}"))
            elif s["state"] == "exited" and s["returncode"] != 0 and s.get("watchdog"):
                found.append((2, f"{who} failed: its collective watchdog fired (a peer stalled)"))
            elif s["state"] == "exited" and s["returncode"] != 0:
                found.append((3, f"{who} failed: it exited with code {s['returncode']}: "
                                 f"{(s['log_tail'].strip().splitlines() or ['(no output)'])[-1]}"))
            elif s["state"] == "running" and p and p["age_s"] > self.options.collective_timeout:
                found.append((1, f"{who} stalled: no step for {p['age_s']:.0f} s"))
            elif s["state"] == "running" and not p and now - self.launcher.started_at > self.options.startup_timeout:
                found.append((1, f"{who} did not start training within {self.options.startup_timeout:.0f} s"))
        return Lost(why=min(found)[1]) if found else None

    def mirror_all(self):
        """Every line rank 0 wrote, mirrored (the ring is done: its last rows may not have come yet)."""
        try:
            rank0 = self.poll(self.state.members[0], metrics_from=0, exchanges_from=0)
            self.mirror.add(rank0.get("metrics", []), rank0.get("exchanges", []))
        except AgentError:
            pass  # rank 0's machine is gone: its last rows with it

    @staticmethod
    def show_on(bar, progress: dict):
        """The progress bar at the slowest member's step, with each one's loss, speed and waits."""
        bar.n = min(p[PROGRESS.step] for p in progress.values())
        bar.set_postfix_str("  ".join(
            f"w{w} {p[PROGRESS.loss]:.3f} {p[PROGRESS.tokens_per_s]:,.0f}tok/s "
            f"sync {p[PROGRESS.sync_s]:.1f}s sent {human_bytes(p.get(PROGRESS.bytes_sent, 0))}"
            for w, p in progress.items()))
        bar.refresh()


class Supervisor:
    def __init__(self, launcher: Launcher):
        self.launcher = l = launcher
        self.state, self.options, self.config, self.log = l.state, l.options, l.config, l.log
        self.mirror = Mirror(l.run_dir)
        self.heartbeat = Heartbeat(l, self.mirror)
        self.status = JobStatus(l.run_dir, self.config.steps, grid_of(l.strategy))
        self.last_steps = {}      # each worker's last reported step: where a lost one left
        self.rank0 = {}           # rank 0's last progress report (its time split: the summary's)
        self.pending_join = None  # a machine admitted at the next sync point
        self.discovered = queue.SimpleQueue()  # agents that appeared on mDNS (discovery.watch's thread)
        self.started_at = process_start()  # the job's wall-clock (this launcher's) counts from here
        self.handlers = {Finished: lambda e: e, Lost: self.recover, StoppedForChange: self.change_members,
                         Joined: self.admit_at_sync}

    # ------------------------------------------------------------ the state machine
    def run(self, resume: bool = False) -> dict:
        """Start (or re-attach to) the job and see it through to the end; its summary."""
        if self.state.finished:
            self.log(f"job {self.state.job} already finished")
            return self.summary()
        if self.options.measure_links and not resume:
            self.launcher.measure_links()
        outcome = self.reattach() if resume else self.start(resume_step=None)
        if self.state.elastic and self.options.discover:
            threading.Thread(target=watch, args=(self.discovered.put,), daemon=True).start()
        while not isinstance(outcome, Finished):
            event = self.watch()
            outcome = self.handlers[type(event)](event)
        self.state.finished = True
        self.state.save(self.launcher.run_dir)
        return self.summary()

    def start(self, resume_step) -> None:
        """Start the ring (the launcher's start); None: it runs, to be watched."""
        self.launcher.start(resume_step)
        self.status.offered = self.launcher.offered

    def reattach(self):
        """After a launcher restart: adopt the workers if they all still run (None: watch them), else
        restart them; Finished if the job turned out to be over."""
        l = self.launcher
        try:
            states = [l.client(m).request("status", job=self.state.job, metrics_from=0,
                                          exchanges_from=protocol.NO_LOG, log_from=protocol.NO_LOG)
                      for m in self.state.members]
            self.status.offered = {m.worker_id: offered_memory(l.client(m).hello()) for m in self.state.members}
        except AgentError as e:
            return self.recover(Lost(why=f"agent unreachable on re-attach ({e})"))
        if all(s["state"] == "running" for s in states) or all(s.get("returncode") == 0 for s in states):
            l.event("reattached", workers=len(states))
            l.started_at = time.time()
            return None
        if all(s.get("returncode") == STOPPED_FOR_CHANGE for s in states):  # the launcher died during a change
            l.event("reattached", workers=len(states), during="a membership change")
            return self.change_members(StoppedForChange({m.worker_id: s["progress"][PROGRESS.stopped]
                                                         for m, s in zip(self.state.members, states)}))
        return self.recover(Lost(why="workers not running on re-attach"))

    # ------------------------------------------------------------ watching
    def watch(self):
        """Poll every agent until the next event."""
        bar = tqdm(total=self.config.steps, desc=f"{self.config.strategy} x{len(self.state.members)} (cluster)",
                   file=sys.stderr, dynamic_ncols=True)
        members = self.state.members
        last_ok = {m.worker_id: time.time() for m in members}
        seen = seen_exchanges = 0  # rank 0's metrics and exchanges lines mirrored since the (re)start
        next_look = time.time()  # machines to admit: looked for every 2 s
        try:
            while True:
                time.sleep(0.5)
                states = {}
                for m in members:
                    try:
                        rank0 = m is members[0]
                        states[m.worker_id] = self.heartbeat.poll(
                            m, metrics_from=seen if rank0 else 0,
                            exchanges_from=seen_exchanges if rank0 else protocol.NO_LOG)
                        last_ok[m.worker_id] = time.time()
                    except AgentError as e:
                        if time.time() - last_ok[m.worker_id] > self.options.heartbeat_timeout:
                            return Lost((m.worker_id,), f"agent of worker {m.worker_id} ({m.host}) silent for "
                                                        f"{self.options.heartbeat_timeout:.0f} s: {e}")
                if rank0 := states.get(members[0].worker_id):
                    seen += len(rank0.get("metrics", []))
                    seen_exchanges += len(rank0.get("exchanges", []))
                    self.mirror.add(rank0.get("metrics", []), rank0.get("exchanges", []))
                self.status.show(members, self.state.spares, states, self.launcher.restart_s)
                if failure := self.heartbeat.failure(states):
                    return failure
                progress = {w: s["progress"] for w, s in states.items() if s.get("progress")}
                self.rank0 = progress.get(members[0].worker_id, self.rank0)
                self.last_steps.update({w: p[PROGRESS.step] for w, p in progress.items()})
                self._note_first_steps(len(progress))
                exited = [s["returncode"] for s in states.values() if s["state"] == "exited"]
                if len(states) == len(members) and len(exited) == len(members) and set(exited) == {STOPPED_FOR_CHANGE}:
                    return StoppedForChange({w: p[PROGRESS.stopped] for w, p in progress.items()})
                if self.state.elastic and time.time() > next_look:
                    next_look = time.time() + 2
                    if joiner := self.joiner():
                        return Joined(joiner)
                if progress:
                    self.heartbeat.show_on(bar, progress)
                if len(states) == len(members) and len(exited) == len(members) and set(exited) == {0}:
                    return Finished()
        finally:
            bar.close()

    # ------------------------------------------------------------ a failure
    def recover(self, lost: Lost):
        """Stop the round everywhere and restart: an elastic job's workers each from their own state,
        another job's from the newest checkpoint every worker holds. Finished if there is nothing left
        to restart (the workers had all finished training)."""
        l = self.launcher
        l.event("failure", why=lost.why)
        self.status.show_all(self.state.members, self.state.spares, "restarting", lost=lost.who)
        self.state.restarts += 1
        if self.state.restarts > self.options.max_restarts:
            raise JobFailed(f"gave up after {self.options.max_restarts} restarts; last failure: {lost.why}")
        if not lost.who and lost.why == self.state.last_failure:  # a restart would fail so again
            raise JobFailed(f"the same failure twice in a row, not retried: {lost.why}")
        self.state.last_failure = "" if lost.who else lost.why
        if self.state.elastic:
            return self._recover_keeping_steps(lost)
        self._begin_change("restart")  # its cost is reported once every worker steps again
        gone = set(lost.who)
        for m in self.state.members:
            try:
                l.client(m).request("stop", job=self.state.job)
            except AgentError:
                gone.add(m.worker_id)
            l.clients.pop((m.address, m.port), None)
        if gone and self.options.on_loss == "shrink":
            self.state.members = [m for m in self.state.members if m.worker_id not in gone]
            if not self.state.members:
                raise JobFailed("no machine of the job is left")
            l.event("shrunk", lost=sorted(gone), workers=len(self.state.members))
        elif gone:
            self._wait_for(gone)
        step = self._common_checkpoint()
        if step == self.config.steps:  # every worker holds the final checkpoint: nothing to redo
            self.heartbeat.mirror_all()
            l.event("finished", step=step)
            return Finished()
        self.mirror.truncate_after(step if step is not None else -1)
        self.state.change["stopped_at"] = time.time()
        return self.start(resume_step=step)

    def _recover_keeping_steps(self, lost: Lost):
        """Every worker saves its own state and exits; the machines that answer form the next ring, each
        worker resuming from its own state. A lost machine's slot leaves (its round is lost; its shard
        waits for a joiner), or, below --min-workers, the job waits for it to answer again."""
        self._begin_change("lost")
        self.pending_join = None  # looked for again once the ring runs
        gone = self._save_and_stop(set(lost.who))
        if gone:
            fewest = len(self.state.members) if self.options.on_loss == "wait" else self.options.min_workers
            if len(self.state.members) - len(gone) < max(1, fewest):
                self._wait_for(gone)  # they resume from their own states
            else:
                self._leave([m for m in self.state.members if m.worker_id in gone])
        return self._restart_from_own_states()

    def _save_and_stop(self, gone: set) -> set:
        """Ask every worker to save its state at the end of its step and exit; stop those that have not
        after the grace period (they wait on a lost peer, and resume from the state they saved before
        that exchange). Returns the workers whose machines no longer answer."""
        l = self.launcher
        for m in self.state.members:
            if m.worker_id not in gone:
                try:
                    l.client(m).request("save_and_exit", job=self.state.job, when="now", after=0)
                except AgentError:
                    gone.add(m.worker_id)
        deadline = time.time() + self.options.stop_grace
        waiting = [m for m in self.state.members if m.worker_id not in gone]
        while waiting and time.time() < deadline:
            time.sleep(0.2)
            waiting = [m for m in waiting if self._still_running(m) and not self._saved_all_it_did(m)]
        for m in waiting:
            self.log(f"[launch] worker {m.worker_id} ({m.host}) did not save within {self.options.stop_grace:g} s: "
                     "it resumes from the newest state it saved")
        for m in self.state.members:
            if m.worker_id not in gone:  # a lost machine's agent would keep us waiting for its timeout
                try:
                    l.client(m).request("stop", job=self.state.job)
                except AgentError:
                    gone.add(m.worker_id)
            l.clients.pop((m.address, m.port), None)
        self.state.change["stopped_at"] = time.time()
        return gone

    def _still_running(self, m: Member) -> bool:
        """Whether its worker still runs; notes the last step it reported."""
        try:
            status = self.launcher.client(m).request("status", job=self.state.job, metrics_from=0,
                                                     exchanges_from=protocol.NO_LOG, log_from=protocol.NO_LOG)
        except AgentError:
            return False
        if status.get("progress"):
            self.last_steps[m.worker_id] = status["progress"][PROGRESS.step]
        return status["state"] == "running"

    def _saved_all_it_did(self, m: Member) -> bool:
        """Whether the worker holds a state saved at the last step it reported: it waits in an exchange
        (with a lost peer it never returns from), having saved before it; stopping it loses nothing."""
        try:
            held = self.launcher.held_steps(m)
        except AgentError:
            return False
        return bool(held) and max(held) >= self.last_steps.get(m.worker_id, 0)

    def _leave(self, lost: list):
        """The lost machines' slots leave the job from the step after the last one each reported."""
        for m in lost:
            step = self.last_steps.get(m.worker_id, 0) + 1
            self.state.record(step, f"-{m.worker_id}", self.config.membership)
            self.state.members.remove(m)
            self.state.spares.append(m)
            m.lost = True
            self.launcher.event("left", worker=m.worker_id, host=m.host, step=step, workers=len(self.state.members))

    def _wait_for(self, lost: set):
        waiting = [m for m in self.state.members if m.worker_id in lost]
        self.launcher.event("waiting", workers=sorted(lost))
        self.status.show_all(self.state.members, self.state.spares, "waiting", lost=lost)
        while waiting:
            time.sleep(2)
            for m in list(waiting):
                try:
                    self.launcher.client(m).request("heartbeat")
                    waiting.remove(m)
                except AgentError:
                    self.launcher.clients.pop((m.address, m.port), None)

    def _common_checkpoint(self):
        """The newest checkpoint step that every member's worker holds (None: start over)."""
        common = None
        for m in self.state.members:
            steps = set(self.launcher.held_steps(m))
            common = steps if common is None else common & steps
        return max(common) if common else None

    # ------------------------------------------------------------ membership changes (elastic jobs)
    def joiner(self):
        """While the ring has room and a free slot, a machine that answers (a lost one, one named with
        --add, or one new on mDNS), given a free slot; None when there is none."""
        while not self.discovered.empty():
            f = self.discovered.get()
            if (f.address, f.port) not in {(m.address, m.port) for m in self.state.members + self.state.spares}:
                self.state.spares.append(Member(f.address, f.port, worker_id=-1, host=f.endpoint))
        cap = self.options.max_workers or self.state.num_shards
        free = sorted(set(range(self.state.num_shards)) - {m.worker_id for m in self.state.members})
        if self.pending_join or len(self.state.members) >= cap or not free or not self._can_admit():
            return None
        for m in list(self.state.spares):
            if self.launcher.ready_to_join(m):
                m.worker_id = m.worker_id if m.worker_id in free else free[0]
                return m
        return None

    def admit_at_sync(self, joined: Joined) -> None:
        """Admit machine `joined.member` at the next sync point: ask every member to save and exit there."""
        m, self.pending_join = joined.member, joined.member
        after = max(self.last_steps.values(), default=0) + 2  # a step no member has reached
        self._begin_change("join")
        for member in self.state.members:
            self.launcher.client(member).request("save_and_exit", job=self.state.job, when="at_sync", after=after)
        self.launcher.event("joining", worker=m.worker_id, host=m.host, after_step=after)

    def _can_admit(self) -> bool:
        """Whether the job admits machines mid-run: not with a planned schedule (it decides who joins
        when), nor when each worker keeps state of its own (exchanges in flight across steps, error
        feedback: a joiner could take no part in it)."""
        return not (self.config.membership or self.launcher.strategy.own_state)

    def change_members(self, stopped: StoppedForChange):
        """Every member saved its state at the same step for a membership change: the machine asked to
        join joins, or the members the schedule plans from the next step on form the ring."""
        states = stopped.states
        self.status.show_all(self.state.members, self.state.spares, "restarting")
        step = max(info[STOP.step] for info in states.values())
        self.last_steps.update({int(w): info[STOP.step] for w, info in states.items()})
        if not self.state.change:
            self._begin_change("planned")
        # The change costs from the moment the first worker stopped training (a joiner waits for a sync point).
        self.state.change["began"] = min(info[STOP.time] for info in states.values())
        self.state.change["stopped_at"] = max(info[STOP.time] for info in states.values())
        joiner, self.pending_join = self.pending_join, None
        if joiner:
            self.state.record(step, f"+{joiner.worker_id}", self.config.membership)
            self._join(joiner)
        elif self.config.membership:  # (else a join asked for before a launcher restart: looked for again)
            planned = set(next(iter(states.values()))[STOP.members])
            for m in [m for m in self.state.members if m.worker_id not in planned]:
                self.state.members.remove(m)
                self.state.spares.append(m)
                self.launcher.event("left", worker=m.worker_id, host=m.host, step=step + 1,
                                    workers=len(self.state.members))
            for slot in sorted(planned - {m.worker_id for m in self.state.members}):
                spare = next((m for m in self.state.spares if m.worker_id == slot and self.launcher.ready_to_join(m)), None)
                if spare is None:
                    raise JobFailed(f"the membership schedule admits worker {slot} after step {step}, but its "
                                    "machine does not answer")
                self._join(spare)
        return self._restart_from_own_states()

    def _join(self, m: Member):
        m.lost = False
        self.state.spares.remove(m)
        self.state.members.append(m)
        self.state.joining.append(m.worker_id)
        self.launcher.event("joined", worker=m.worker_id, host=m.host, workers=len(self.state.members))

    def _begin_change(self, kind: str):
        self.state.change = {"kind": kind, "began": time.time()}

    def _restart_from_own_states(self):
        """Start the ring of the members from their own states (Finished: they had all finished)."""
        self.state.save(self.launcher.run_dir)
        steps = self.launcher.own_states()
        if all(s == self.config.steps for w, s in steps.items() if w not in self.state.joining):
            self.heartbeat.mirror_all()
            self.launcher.event("finished", step=self.config.steps)
            return Finished()
        self.state.change["redone_steps"] = {str(w): self.last_steps.get(w, 0) - s for w, s in steps.items()
                                             if s is not None and w in self.last_steps}
        self.mirror.truncate_after(min([s for s in steps.values() if s is not None], default=-1))
        return self.start(resume_step=None)

    def _note_first_steps(self, stepping: int):
        """Once every worker of a new ring has taken a step (`stepping`: those that have): the change (or
        the restart) is over; report its cost."""
        change = self.state.change
        if not change or "started_at" not in change or stepping < len(self.state.members):
            return
        now, began = time.time(), change["began"]
        self.launcher.event(
            "restarted" if change["kind"] == "restart" else "membership_change", change=change["kind"],
            workers=len(self.state.members), stop_s=round(change["stopped_at"] - began, 2),
            start_s=round(change["started_at"] - change["stopped_at"], 2),
            first_step_s=round(now - change["started_at"], 2), total_s=round(now - began, 2),
            redone_steps=change.get("redone_steps", {}))
        self.state.change, self.state.joining = {}, []
        self.state.save(self.launcher.run_dir)

    # ------------------------------------------------------------ the end
    def time_split(self, last: dict) -> dict:
        """Where the job's wall-clock (this launcher's) went: rank 0's split (its processes': its last report,
        else its last row), with the launcher's own start-up (setting the job up until its first ring
        started) and its restarts (no ring trained: events.jsonl's)."""
        split = dict(self.rank0.get(PROGRESS.time_s) or last.get(ROW.time_s) or dict.fromkeys(TIME, 0.0))
        split[TIME.startup_s] += max(0.0, (self.launcher.first_started_at or time.time()) - self.started_at)
        split[TIME.restart_s] += self.launcher.restart_s
        return split

    def summary(self) -> dict:
        """The job's summary (records.SUMMARY, as sim's): rank 0's last metrics row, with its objective's
        summary keys (a GRPO job's tokens generated and trained, its seconds generating and training, its
        held-out accuracy), and what the launcher knows of the job (its restarts and changes); what only
        the workers know (the model) is None."""
        from ..objectives import objective_class
        last = (self.mirror.rows() or [{}])[-1]
        same = (ROW.strategy, ROW.tokens, ROW.examples, ROW.tokens_per_shard, ROW.inner_steps_lost,
                ROW.bytes_sent_per_worker, ROW.peak_exchange_bytes, ROW.compute_s, ROW.utilisation,
                ROW.measured_utilisation, ROW.busy_s, ROW.link_s, ROW.straggler_s, ROW.mfu, ROW.flops_per_token,
                ROW.peak_gflops, ROW.peak_memory_bytes, ROW.workers_per_process, ROW.wall_s,
                *objective_class(self.config.objective).summary_keys)
        summary = run_summary(
            **{key: last.get(key) for key in same}, run_dir=str(self.launcher.run_dir), job=self.state.job,
            workers=len(self.state.members), steps=last.get(ROW.step), final_eval_loss=last.get(ROW.eval_loss),
            modelled_comm_s=last.get(ROW.comm_s), restarts=self.state.restarts, restart_s=self.launcher.restart_s,
            changes=[e for e in self.launcher.events_so_far() if e[EVENT.event] in RESTARTS],
            process_s=time.time() - self.started_at, time_s=self.time_split(last))
        self.launcher.write_summary(summary)
        return summary
