"""`mlx-diloco sim --processes K`: the simulator on every core.

K local processes each train N/K vmapped workers (MLX runs a CPU stream's elementwise work on one
thread, so one process leaves cores idle), joined by MLX's ring over 127.0.0.1: the same worker
program, job file (worker_job.py) and ring transport as a real cluster, with K processes of N/K workers instead of N
machines of one. Every strategy runs unchanged. Each process gets its share of BLAS threads.
Process 0 reports (progress, metrics, checkpoints in the run folder); a process that fails ends
the run with its last line; one that hangs is ended by its watchdog.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ..config import ConfigError, TrainConfig
from ..run_folder import candidates, check_new_run_dir, flaw, latest_step
from ..worker_job import WorkerJob


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def checkpoint_dirs(run_dir: Path) -> list:
    """Where each process of the run in `run_dir` checkpoints: process 0 in the run folder, each
    other process in worker-W, W the number of its first worker."""
    others = sorted(d for d in Path(run_dir).glob("worker-*") if latest_step(d) is not None)
    return [Path(run_dir), *others]


def saved_processes(run_dir: Path) -> int:
    """How many processes trained the run in `run_dir`."""
    return len(checkpoint_dirs(run_dir))


def resume_step(run_dir: Path, log=print) -> int:
    """The newest checkpoint that every process saved whole: all resume from the same step. A
    damaged one (a crash while writing) is passed over, as checkpoint.load does in one process."""
    dirs, damaged = checkpoint_dirs(run_dir), []
    for step in candidates(run_dir):
        flaws = [f"checkpoint {step} in {d} is unreadable ({why})"
                 for d in dirs if (why := flaw(d, step))]
        if not flaws:
            for line in damaged:
                log(f"{line}; using checkpoint {step}")
            return step
        damaged += flaws
    if not damaged:
        raise ConfigError(f"nothing to resume in {run_dir}: no checkpoint; drop --resume to start a new run")
    raise ConfigError(f"no intact checkpoint in {run_dir}: {'; '.join(damaged)}; start a new run")


def choose_processes(workers: int, requested: int = 0, run_dir=None, resume: bool = False) -> int:
    """K for `sim`: as requested, as the resumed run had it, or by default one per core on a machine
    that trains on the CPU (bench/throughput.py: 2 processes of 2 workers run ~1.5x the tokens/s of
    one process of 4 on 2 cores), the largest count that divides the workers; 1 on a GPU."""
    if requested < 0:
        raise ConfigError(f"--processes must be >= 1, or 0 for one per core (got {requested})")
    if resume:
        saved = saved_processes(run_dir)
        if requested and requested != saved:
            raise ConfigError(f"the run in {run_dir} was trained in {saved} processes; drop --processes "
                              f"or pass --processes {saved}")
        return saved
    if requested:
        return requested
    import mlx.core as mx
    if mx.default_device() != mx.cpu:
        return 1
    return max(k for k in range(1, min(usable_cores(), workers) + 1) if workers % k == 0)


def free_ports(n: int) -> list:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def failure(procs: list, logs: list, errors: list, run_dir: Path) -> str:
    """One line on the process that failed, or ''. A process that stopped on bad input wrote its
    error to its file in `errors` (cli.main): that line is the run's. Else a peer's death makes the
    others' collectives fail too, so a process killed by a signal is named before one that exited
    with an error; and --resume is suggested only where a checkpoint is there to resume."""
    failed = sorted(((r, p.returncode) for r, p in enumerate(procs) if p.poll() not in (None, 0)),
                    key=lambda f: (f[1] > 0, f[0]))
    if not failed:
        return ""
    if said := [errors[r].read_text() for r, _ in failed if errors[r].exists()]:
        return said[0]
    r, code = failed[0]
    tail = logs[r].read_text(errors="replace").strip().splitlines()[-1:] if r else []
    then = ("the run stops, resume it with --resume" if latest_step(run_dir) is not None else
            "the run stopped before its first checkpoint, so there is nothing to resume: start it again "
            "in a new --run-dir")
    return f"simulator process {r} of {len(procs)} failed (exit {code})" + (f": {tail[0]}" if tail else "") + \
        f"; {then}"


def run_processes(config: TrainConfig, run_dir: Path, processes: int, resume: bool = False, log=print):
    """Train `config` in `processes` local processes; returns when all have finished."""
    from .resolve import load_data, resolve
    K, run_dir = processes, Path(run_dir)
    if config.workers % K:
        raise ConfigError(f"{config.workers} workers do not split over {K} processes; "
                          "pass --workers as a multiple of --processes")
    step = resume_step(run_dir, log) if resume else None
    if not resume:
        check_new_run_dir(run_dir)
    resolved = resolve(config)
    config = resolved.config  # the processes are given it as resolved: this process says its notes
    load_data(config, resolved.spec, log=log)  # tokenize once here: the processes read the cache
    for note in resolved.notes:  # once the data is found: no line before an error
        log(note)
    log(f"{config.strategy} with {config.workers} simulated workers in {K} processes, model {config.model}, "
        f"data {config.data} -> {run_dir}")
    threads = str(max(1, usable_cores() // K))  # BLAS threads: K processes share the cores, no more
    with tempfile.TemporaryDirectory(prefix="mlx-diloco-sim-") as tmp:
        job, hostfile = Path(tmp) / "job.json", Path(tmp) / "hosts.json"
        WorkerJob(config.to_dict(), str(run_dir), workers_per_process=config.workers // K, resume_step=step,
                  sim_pid=os.getpid()).write(job)
        hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(K)]))
        args = [sys.executable, "-m", "mlx_diloco", "worker", "--job", str(job)]
        logs = [Path(tmp) / f"process-{r}.log" for r in range(K)]
        errors = [Path(tmp) / f"process-{r}.error" for r in range(K)]  # bad input: one line, said here once
        # The processes import what this one can (a model builder or loss function named by module).
        python_path = os.pathsep.join(p for p in sys.path if p and Path(p).is_dir())
        procs = []
        for r in range(K):  # process 0 speaks to the terminal; the others to their logs
            env = {**os.environ, "MLX_RANK": str(r), "MLX_HOSTFILE": str(hostfile), "OPENBLAS_NUM_THREADS": threads,
                   "PYTHONPATH": python_path, "MLX_DILOCO_ERROR_FILE": str(errors[r])}
            out = None if r == 0 else open(logs[r], "wb")
            procs.append(subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT if out else None))
        try:
            while any(p.poll() is None for p in procs) and not failure(procs, logs, errors, run_dir):
                time.sleep(0.2)
            if any(p.poll() in (-signal.SIGINT, 130) for p in procs):
                raise KeyboardInterrupt  # Ctrl-C reached the processes first: say so, not "failed"
            if why := failure(procs, logs, errors, run_dir):
                raise ConfigError(why)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()


def exit_with_parent(parent: int):
    """In a process that sim (process id `parent`) started: exit once sim is gone. A sim killed
    outright (SIGTERM, SIGKILL) never reaches the `finally` that stops its processes, and they would
    train on alone. The id comes from sim: one read here could be init's, sim killed while this
    process was still importing MLX."""
    def watch():
        while os.getppid() == parent:
            time.sleep(1)
        os._exit(1)
    threading.Thread(target=watch, daemon=True).start()


def simulate(config: TrainConfig, run_dir: Path, processes: int = 0, resume: bool = False, log=print,
             callbacks=None) -> dict:
    """Train `config`'s simulated workers on this machine (in `processes` processes; 0: one per
    core on a CPU) and return the run's summary: what `sim`, `gym run` and `sweep` do. `callbacks`
    (one process) hear the run (training/callbacks.py)."""
    from ..exchange.comm import SimCommunicator
    from .run import Run
    run_dir = Path(run_dir)
    K = choose_processes(config.workers, processes, run_dir, resume)
    if K > 1:
        run_processes(config, run_dir, K, resume=resume, log=log)
        return json.loads((run_dir / "summary.json").read_text())
    run = Run(config, run_dir, SimCommunicator(config.workers), resume=resume, log=log, callbacks=callbacks)
    log(f"{run.config.strategy} with {run.config.workers} simulated workers, model {run.config.model} "
        f"({run.n_params / 1e6:.2f}M parameters), data {run.config.data} -> {run_dir}")
    return run.train()
