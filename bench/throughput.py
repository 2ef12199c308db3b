"""Simulator throughput: how does it compare with plain PyTorch, and what does simulating N workers
cost, in K processes?

    python bench/throughput.py [--model small] [--workers 2 4 8] [--processes 1 2 4] [--steps 10]
                               [--tables pytorch processes] [--vs-pytorch 1 4 8]

Each table is measured side by side in one run (round-robin, one step of each setup per round).
The PyTorch table (needs torch: pip install -e '.[bench]'): tokens/s of bench/torch_baseline.py, one
worker of batch B in its own process with PyTorch's default threads, and of the project at N = 1, 4,
8 workers of batch B (`--vs-pytorch`) in the processes `sim` picks by default (one per core on a
CPU), as ratios to it; best step and median step of `--steps` rounds. Targets (issue 22): 1.0x
or more at every N. The processes table, each setup's best step, tokens/s of:
  - one worker with an N-times batch in one process: the same arithmetic without simulation;
  - the simulator, N workers of batch B in K processes (`sim --processes K`): N/K vmapped workers
    each, joined by MLX's ring over loopback, each process with cores/K BLAS threads;
  - K = 2 with every process using all the cores for BLAS (no pinning: the wrong setting).
Targets (issue 12, 2 cores): N=4 in K=2 processes at least 1.4x the tokens/s of one process, and
no worse than one worker with a 4x batch.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_diloco.blas import ensure_fast_blas  # noqa: E402

if __name__ == "__main__":
    ensure_fast_blas(sys.argv)


def make_setup(model_name, workers, batch_size, seq_len, comm=None):
    """A ready-to-step closure training this process's replicas (all `workers`, or comm's share)."""
    import mlx.core as mx
    from mlx_diloco.config import TrainConfig
    from mlx_diloco.data.datasets import prepare
    from mlx_diloco.exchange.comm import SimCommunicator
    from mlx_diloco.models.zoo import build_model, load_spec
    from mlx_diloco.strategies import make_strategy
    from mlx_diloco.training.workers import Workers

    comm = comm or SimCommunicator(workers)
    config = TrainConfig.from_dict(dict(model=model_name, workers=workers, batch_size=batch_size,
                                        seq_len=seq_len, sync_every=10_000))
    spec = load_spec(model_name)
    data = prepare(config.data, seq_len, spec.vocab_size, log=lambda m: None)
    model = build_model(spec)
    strategy = make_strategy(config.strategy, config.strategy_options).bind(comm, config.steps)
    strategy.setup(model.trainable_parameters())
    w = Workers(model, comm.n_local, config, strategy.inner_optimizer(config))
    n = comm.n_local
    x, y = (mx.array(a.reshape(n, batch_size, -1)) for a in data.train.get(range(n * batch_size)))
    step = iter(range(1, 1 << 30))
    return lambda: w.step(x, y, strategy, next(step))


def child(model_name, workers, batch_size, seq_len, per_process):
    """One process of a ProcessGroup: steps its replicas whenever the parent writes a line."""
    from mlx_diloco.exchange.ring import init_ring
    step = make_setup(model_name, workers, batch_size, seq_len, init_ring(60.0, per_process))
    print("ready", flush=True)
    for _ in sys.stdin:
        step()
        print("done", flush=True)


class StepProcesses:
    """Processes that each build a setup, print a line starting with 'ready', then run one step for
    each line they read and print 'done'; calling this runs one step in all of them."""

    def __init__(self, args, envs):
        self.procs = [subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
                      for env in envs]
        self.ready = [p.stdout.readline().strip() for p in self.procs]
        if not all(line.startswith("ready") for line in self.ready):
            self.close()
            raise RuntimeError(f"{Path(args[1]).name} {args[2]} failed to start "
                               f"(exit {[p.returncode for p in self.procs]})")

    def __call__(self):
        for p in self.procs:
            p.stdin.write("step\n")
            p.stdin.flush()
        for p in self.procs:
            p.stdout.readline()

    def close(self):
        for p in self.procs:
            p.stdin.close()
            p.wait()


class ProcessGroup(StepProcesses):
    """`sim --processes K` without the run around it: K processes joined by MLX's ring, each
    stepping workers/K vmapped replicas."""

    def __init__(self, model_name, workers, batch_size, seq_len, K, blas_threads):
        from mlx_diloco.training.processes import free_ports
        self.tmp = tempfile.TemporaryDirectory(prefix="bench-throughput-")
        hostfile = Path(self.tmp.name) / "hosts.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(K)]))
        args = [sys.executable, __file__, "--child", model_name, str(workers), str(batch_size), str(seq_len),
                str(workers // K)]
        super().__init__(args, [{**os.environ, "MLX_RANK": str(r), "MLX_HOSTFILE": str(hostfile),
                                 "OPENBLAS_NUM_THREADS": str(blas_threads)} for r in range(K)])

    def close(self):
        super().close()
        self.tmp.cleanup()


class PyTorchBaseline(StepProcesses):
    """bench/torch_baseline.py's step in its own process, as a PyTorch user runs it: without the
    OpenBLAS preload and thread settings this bench runs MLX with, so with PyTorch's own defaults."""

    def __init__(self, model_name, batch_size, seq_len):
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
        env["LD_PRELOAD"] = ":".join(lib for lib in env.get("LD_PRELOAD", "").split(":") if "openblas" not in lib)
        super().__init__([sys.executable, str(Path(__file__).with_name("torch_baseline.py")), "--serve",
                          "--model", model_name, "--batch-size", str(batch_size), "--seq-len", str(seq_len)], [env])
        self.label = self.ready[0].removeprefix("ready ")  # "PyTorch 2.13.0, 2 threads"


def step_times(setups: dict, rounds: int) -> dict:
    """Round-robin over the setups, one step each per round: every setup sees the same machine
    conditions (this CPU's speed drifts by tens of %). Each setup's step times, in seconds."""
    for run in setups.values():  # warm-up
        run(), run()
    times = {name: [] for name in setups}
    for _ in range(rounds):
        for name, run in setups.items():
            t = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t)
    return times


def default_setup(model_name, workers, batch_size, seq_len, cores):
    """The project's N workers in the processes `sim` runs them in by default, and its label."""
    from mlx_diloco.training.processes import choose_processes
    K = choose_processes(workers)
    label = f"sim {workers} worker{'s' if workers > 1 else ''}, {K} process{'es' if K > 1 else ''}"
    if K == 1:
        return make_setup(model_name, workers, batch_size, seq_len), label
    return ProcessGroup(model_name, workers, batch_size, seq_len, K, max(1, cores // K)), label


def print_pytorch_table(args, B, cores):
    """The project's tokens/s at each N of --vs-pytorch as ratios to the PyTorch baseline's."""
    import importlib.util
    if importlib.util.find_spec("torch") is None:
        print("\nno PyTorch comparison: torch is not installed; pip install -e '.[bench]'")
        return
    T = args.seq_len
    try:
        setups = {"pytorch": PyTorchBaseline(args.model, B, T)}
    except RuntimeError as e:  # its process said why on stderr
        print(f"\nno PyTorch comparison: {e}")
        return
    labels = {"pytorch": f"{setups['pytorch'].label}, 1 worker"}
    try:
        for n in args.vs_pytorch:
            setups[n], labels[n] = default_setup(args.model, n, B, T, cores)
        times = step_times(setups, args.steps)
    finally:
        for s in setups.values():
            if isinstance(s, StepProcesses):
                s.close()

    def tokens_per_s(key, pick):
        return (1 if key == "pytorch" else key) * B * T / pick(times[key])

    print(f"\nmodel {args.model}, B={B}, T={T}, {cores} cores; {args.steps} interleaved steps each\n")
    print(f"{'setup':44} {'tokens/s best':>14} {'median':>10} {'vs PyTorch best':>16} {'median':>8}")
    for key in setups:
        best, median = tokens_per_s(key, min), tokens_per_s(key, statistics.median)
        print(f"{labels[key]:44} {best:14,.0f} {median:10,.0f} "
              f"{best / tokens_per_s('pytorch', min):16.2f} {median / tokens_per_s('pytorch', statistics.median):8.2f}")


def print_table(args, B, cores):
    T = args.seq_len
    setups, groups = {}, []
    for n in args.workers:
        setups[(n, "batch")] = make_setup(args.model, 1, n * B, T)
        for K in args.processes:
            if n % K:
                continue
            if K == 1:
                setups[(n, 1)] = make_setup(args.model, n, B, T)
            else:
                groups.append(ProcessGroup(args.model, n, B, T, K, max(1, cores // K)))
                setups[(n, K)] = groups[-1]
        if 2 in args.processes and n % 2 == 0 and cores > 1:
            groups.append(ProcessGroup(args.model, n, B, T, 2, cores))
            setups[(n, "unpinned")] = groups[-1]
    try:
        best = {name: min(times) for name, times in step_times(setups, args.steps).items()}
    finally:
        for g in groups:
            g.close()

    print(f"\nmodel {args.model}, B={B}, T={T}, {cores} cores; best of {args.steps} interleaved steps each\n")
    print(f"{'setup':44} {'s/step':>8} {'tokens/s':>10} {'vs 1 process':>13} {'vs 1 worker N*B':>16}")
    for n in args.workers:
        big, one = best[(n, "batch")], best.get((n, 1))
        for key, t in ((k, t) for k, t in best.items() if k[0] == n):
            what = key[1]
            if what == "batch":
                label = f"1 worker, batch {n}*B, 1 process"
            elif what == "unpinned":
                label = f"sim {n} workers, 2 processes, {cores} BLAS threads each"
            else:
                label = f"sim {n} workers, {what} process{'es' if what > 1 else ''}"
            vs_one = f"{one / t:13.2f}" if one and what != "batch" else " " * 13
            print(f"{label:44} {t:8.3f} {n * B * T / t:10,.0f} {vs_one} {big / t:16.2f}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small", help="model preset")
    p.add_argument("--batch-size", type=int, nargs="+", default=[16, 8],
                   help="B: sequences per worker per step; one table each (16 is the trainer's default)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    p.add_argument("--steps", type=int, default=10,
                   help="timed rounds (the processes table keeps each setup's best step; the PyTorch table "
                        "its best and median)")
    p.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8], help="simulated worker counts N")
    p.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4], help="process counts K")
    p.add_argument("--vs-pytorch", type=int, nargs="+", default=[1, 4, 8],
                   help="worker counts N measured against the PyTorch baseline, in sim's default processes")
    p.add_argument("--tables", nargs="+", choices=["pytorch", "processes"], default=["pytorch", "processes"],
                   help="which tables to measure, for each batch size")
    p.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        model, *numbers = args.child
        return child(model, *map(int, numbers))
    from mlx_diloco.training.processes import usable_cores
    for B in args.batch_size:
        if "pytorch" in args.tables:
            print_pytorch_table(args, B, usable_cores())
        if "processes" in args.tables:
            print_table(args, B, usable_cores())


if __name__ == "__main__":
    main()
