"""A run's live status: `status.json` in its folder, what each worker is doing now, rewritten at
most twice a second while the run trains. The dashboard (dashboard/) reads it; nothing resumes
from it. MLX-free: the launcher writes it for a cluster, a callback (training/callbacks.py) for sim.

    {"time": unix seconds, "source": "sim" | "launch", "step": the job's, "steps": the run's,
     "workers": [a row of records.STATUS per worker: its machine, state, step, steps per second,
                 tokens per second, loss and, when known, the keys of PASSED]}

A process of `sim --processes` that is not the reporter writes the workers it trains to
`worker-W/status.json` (its checkpoint folder): `read` joins the parts.
"""

import json
import os
import time
from collections import deque
from pathlib import Path

from .atomic import atomic_write_text
from .records import PROGRESS, STATUS

FILE = "status.json"
INTERVAL_S = 0.5  # the least time between two writes

# What a worker can be doing. On a cluster, a worker whose last step is older than a few of its
# step times is blocked in a collective: syncing at a sync point, else waiting (on a stalled peer).
STATES = {
    "starting": "loading its model and data, no step yet",
    "training": "taking inner steps",
    "syncing": "in an exchange with the other workers",
    "waiting": "waiting on others: a stalled peer, slower workers, its turn in a membership schedule",
    "restarting": "saving its state and stopping for a new ring (a failure, a join, a planned change)",
    "failed": "its process died (the launcher restarts the ring)",
    "lost": "its machine does not answer",
    "done": "trained every step",
}

# Keys of a train report (or a cluster worker's progress file) passed through as they are.
PASSED = (PROGRESS.sync_s, PROGRESS.bytes_sent, PROGRESS.compute_s, PROGRESS.link_s, PROGRESS.straggler_s,
          PROGRESS.mfu, PROGRESS.memory_bytes, PROGRESS.memory_limit_bytes, PROGRESS.process_s, PROGRESS.time_s)


class StepRate:
    """Each worker's steps per second over the last few seconds of its reported steps."""

    def __init__(self, window_s: float = 5.0):
        self.window_s, self.seen = window_s, {}  # worker -> deque of (time, step)

    def __call__(self, worker, when: float, step: int):
        seen = self.seen.setdefault(worker, deque())
        if seen and step < seen[-1][1]:  # resumed from an earlier step: start over
            seen.clear()
        if not seen or seen[-1] != (when, step):
            seen.append((when, step))
        while len(seen) > 2 and when - seen[1][0] >= self.window_s:
            seen.popleft()
        (t0, s0), (t1, s1) = seen[0], seen[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 else None


class StatusWriter:
    """Writes `folder/status.json`, at most once every INTERVAL_S unless forced."""

    def __init__(self, folder: Path, source: str):
        self.path, self.source, self.written = Path(folder) / FILE, source, 0.0

    def due(self) -> bool:
        return time.time() - self.written >= INTERVAL_S

    def write(self, step: int, steps: int, workers: list, force: bool = False):
        if not (force or self.due()):
            return
        self.written = time.time()
        atomic_write_text(self.path, json.dumps({"time": self.written, "source": self.source, "step": step,
                                                 "steps": steps, "workers": workers}), durable=False)


def passed(report: dict) -> dict:
    """The keys of PASSED a report holds."""
    return {k: report[k] for k in PASSED if report.get(k) is not None}


def read(run_dir: Path, say=lambda message: None):
    """The run's status (None before its first write): status.json, with the workers the other
    processes of a `sim --processes` run wrote in worker-W/status.json. A row that is not a worker's
    (not an object, a worker id that is not a number) is left out and `say`s so."""
    run_dir = Path(run_dir)
    status = _read_json(run_dir / FILE, run_dir)
    if status is None:
        return None
    for part in sorted(run_dir.glob(f"worker-*/{FILE}")):
        if (other := _read_json(part, run_dir)) and other.get("source") == status.get("source"):
            status["workers"] += other["workers"]
    rows = []
    for w in status["workers"]:
        if isinstance(w, dict) and _is_id(w.get(STATUS.worker)):
            rows.append(w)
        else:
            say(f"passed over a row of {FILE} that is not a worker's: {json.dumps(w)[:200]}")
    status["workers"] = sorted(rows, key=lambda w: (w.get(STATUS.worker) is None, w.get(STATUS.worker) or 0))
    return status


def _is_id(worker) -> bool:
    """A worker id: a whole number, or None (a machine waiting to join, without a slot yet)."""
    return worker is None or (isinstance(worker, int) and not isinstance(worker, bool))


def within(run_dir: Path, path: Path) -> bool:
    """Whether `path`, its links followed, is inside the run folder (a link out of it is not the run's)."""
    return Path(os.path.realpath(path)).is_relative_to(os.path.realpath(run_dir))


def _read_json(path: Path, run_dir: Path):
    if not within(run_dir, path):
        return None
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) and isinstance(value.get("workers"), list) else None
