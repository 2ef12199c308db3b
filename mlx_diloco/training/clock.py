"""How far a run is and where its time went, every second of it.

`RunClock` keeps the run's steps done and the measured compute time of one worker (which a checkpoint
keeps, and a joiner takes from a member: elastic.py), and splits the run's wall-clock in this process,
from its start (a process started for it, a worker's: the process's start, the package's import; a
run in a process that does more, the API's: the Run's making) to now, into records.TIME's parts:
start-up until the first step;
then each tick's time, less what its `part`s took (saves, evaluations, generation) and the waits in
exchanges the communicator measured (for the link, for slower workers), is its compute. The parts
sum to the wall-clock by construction, but for the moments between the ticks (callbacks' reports;
under 1% measured: bench/cluster_streaming.py). A resumed run carries the split of the processes
before it (its checkpoint's meta).
"""

import math
import time
from contextlib import contextmanager

import mlx.core as mx
import numpy as np

from ..records import OPTIONAL_META, PROGRESS, ROW, TIME
from ..machine.utilisation import mfu, peak_gflops


class RunClock:
    def __init__(self, comm, started_at: float, flops_per_token: float = None):
        """`comm`: the run's communicator, which measures the waits in exchanges (for the link, for slower
        workers); `started_at`: when the run started in this process (Unix time); `flops_per_token`: the
        model's training FLOPs per token (None: not a language model), its MFU's."""
        self.started_at = started_at
        self.steps = 0           # steps done (the job-wide tick)
        self.compute_s = 0.0     # measured compute time of one worker (its ticks, as speeds.py models them)
        self.comm = comm
        self.run_started = time.time()  # a row's wall_s counts from here (the model and data made)
        self.flops_per_token = flops_per_token
        self.peak_gflops = peak_gflops() if flops_per_token else None
        self.tokens = 0          # tokens this process trained (its MFU over its wall-clock time)
        self.here = dict.fromkeys(TIME, 0.0)  # this process's, but start-up and the tick under way: `split`
        self.carried = dict.fromkeys(TIME, 0.0)  # the processes' before it (a resumed run's checkpoint)
        self.carried_s = 0.0
        self.ticking_since = None  # when the first tick began (start-up until then)
        self._tick = None        # the tick under way: (its start, the waits then), and its parts so far
        self._parts = []         # the parts under way: (key, start, waits then)

    @contextmanager
    def part(self, key: str):
        """Time spent inside counts as `key` (records.TIME), its waits on exchanges included (inside
        another part: as that one)."""
        if self._parts:
            yield
            return
        self._parts.append((key, time.perf_counter(), self.waits()[0]))
        try:
            yield
        finally:
            _, t0, w0 = self._parts.pop()
            elapsed, waited = time.perf_counter() - t0, self.waits()[0] - w0
            self.here[key] += elapsed
            if self._tick:
                self._tick_parts[0] += elapsed
                self._tick_parts[1] += waited

    @contextmanager
    def tick(self):
        """One tick of the run: what its parts and the exchanges' waits did not take is compute."""
        if self.ticking_since is None:
            self.ticking_since = time.time()
        self._tick, self._tick_parts = (time.perf_counter(), *self.waits()), [0.0, 0.0]
        try:
            yield
        finally:
            for key, seconds in self._tick_division().items():
                self.here[key] += seconds
            self._tick = None

    def _tick_division(self) -> dict:
        """The tick under way so far, by part: its waits in exchanges outside its parts (for the link, for
        slower workers), and the rest of what its parts did not take, compute."""
        t0, w0, s0 = self._tick
        w1, s1 = self.waits()
        parts_s, parts_wait = self._tick_parts
        for _, t, w in self._parts:  # a part under way: its time so far is its own
            parts_s += time.perf_counter() - t
            parts_wait += w1 - w
        waited = max(0.0, w1 - w0 - parts_wait)
        straggled = min(s1 - s0, waited)
        return {TIME.link_s: waited - straggled, TIME.straggler_s: straggled,
                TIME.compute_s: max(0.0, time.perf_counter() - t0 - parts_s - waited)}

    def waits(self) -> tuple:
        return self.comm.wait_s, self.comm.straggler_s

    def run_s(self) -> float:
        """Seconds since this process started the run (the model and data made)."""
        return time.time() - self.run_started

    def wall(self) -> float:
        """Seconds since this process started (and those of the processes before it)."""
        return self.carried_s + time.time() - self.started_at

    def split(self) -> dict:
        """Where the wall-clock went until now, by part (records.TIME, s): start-up until the first tick,
        the parts and the ticks since, those under way so far included."""
        now = {**self.here, TIME.startup_s: (self.ticking_since or time.time()) - self.started_at}
        for key, t0, _ in self._parts:
            now[key] += time.perf_counter() - t0
        for key, seconds in (self._tick_division().items() if self._tick else ()):
            now[key] += seconds
        return {k: self.carried[k] + now[k] for k in TIME}

    def spent(self) -> dict:
        """Where this process's time went (PROGRESS's keys): its workers' compute, its waits for the link
        and for slower workers, its split and wall-clock, and its model FLOPs utilisation over the time
        since it started the run (utilisation.py)."""
        split, wall = self.split(), self.run_s()
        rate = self.tokens / wall if wall > 0 else None
        gflops = rate and self.peak_gflops and self.flops_per_token * rate / 1e9
        if gflops and gflops > self.peak_gflops:  # the peak was measured while other work ran (utilisation.py)
            self.peak_gflops = peak_gflops(beaten_by=gflops)
        return {PROGRESS.compute_s: self.compute_s * self.comm.n_local, PROGRESS.link_s: split[TIME.link_s],
                PROGRESS.straggler_s: split[TIME.straggler_s],
                PROGRESS.mfu: mfu(self.flops_per_token, rate, self.peak_gflops) if rate is not None else None,
                PROGRESS.process_s: self.wall(), PROGRESS.time_s: split}

    def job_spent(self) -> dict:
        """Where the processes' time went (ROW's keys; the mean over them: busy_s their compute) and the
        job's MFU (the mean of theirs, each against its own peak: on a machine the processes share, the
        share of the cores it may use). Every process takes part (a gather)."""
        spent = self.spent()
        mine = [spent[PROGRESS.compute_s], spent[PROGRESS.link_s], spent[PROGRESS.straggler_s],
                math.nan if spent[PROGRESS.mfu] is None else spent[PROGRESS.mfu], spent[PROGRESS.process_s],
                *spent[PROGRESS.time_s].values()]
        every = np.array(self.comm.gather_metric(mx.array([mine] * self.comm.n_local))).mean(axis=0).tolist()
        (busy, link, straggler, mfus, wall), split = every[:5], dict(zip(TIME, every[5:]))
        return {ROW.busy_s: busy, ROW.link_s: link, ROW.straggler_s: straggler,
                ROW.mfu: None if math.isnan(mfus) else mfus, ROW.process_s: wall, ROW.time_s: split}

    def state(self) -> dict:
        """What a checkpoint's meta keeps (records.OPTIONAL_META's time_s)."""
        return {OPTIONAL_META.time_s: {"split": self.split(), ROW.process_s: self.wall()}}

    def load_state(self, meta: dict):
        """The split of the processes before this one, from a checkpoint's meta (one from before the split
        was kept: its waits, records.OPTIONAL_META's waits_s)."""
        if kept := meta.get(OPTIONAL_META.time_s):
            self.carried = {k: kept["split"].get(k, 0.0) for k in TIME}
            self.carried_s = kept[ROW.process_s]
        elif waits := meta.get(OPTIONAL_META.waits_s):
            self.carried.update({TIME.link_s: waits[ROW.link_s], TIME.straggler_s: waits[ROW.straggler_s]})
