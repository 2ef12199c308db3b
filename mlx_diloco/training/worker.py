"""`mlx-diloco worker --job FILE`: one worker of a cluster job (started by its machine's agent) or
of `sim --processes` (started by sim), as its job file says (worker_job.py); its rank and peers
from MLX's environment. The run is built from the job (`Run.from_job`) and trains to the end, or
until the launcher asks it to save its state for a membership change."""

import os
import sys

from ..data.datasets import TEXT_NOTICES
from ..worker_job import STOPPED_FOR_CHANGE, WorkerJob
from .processes import exit_with_parent
from .elastic import StoppedForChange
from .run import Run


def work(path) -> dict:
    """Train the job in file `path`; the run's summary, for the process that reports it (rank 0 of
    a cluster job; None elsewhere: sim reports its own)."""
    job = WorkerJob.read(path)
    if job.simulated:
        exit_with_parent(job.sim_pid)
    run = Run.from_job(job, log=worker_log(job.simulated))
    try:
        summary = run.train()
    except StoppedForChange as e:  # the launcher starts the job's next ring
        print(e, file=sys.stderr, flush=True)
        sys.stdout.flush()
        # Now, without the interpreter's teardown: MLX's ring can hang closing its sockets to a lost peer.
        os._exit(STOPPED_FOR_CHANGE)
    return summary if run.reporter and not job.simulated else None


def worker_log(simulated: bool):
    """Log lines to stderr; a process of `sim` leaves what reading the data says to sim, which
    read it first (else a warning about the data shows twice)."""
    def log(message: str):
        if not (simulated and message.startswith(TEXT_NOTICES)):
            print(message, file=sys.stderr)
    return log
