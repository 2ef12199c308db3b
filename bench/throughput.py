"""Simulator throughput: what does simulating N workers cost, in K processes?

    python bench/throughput.py [--model small] [--workers 2 4 8] [--processes 1 2 4] [--steps 10]

Measures, side by side in one run (round-robin, one step of each setup per round, each setup's best
step kept), tokens/s of:
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


class ProcessGroup:
    """`sim --processes K` without the run around it: K processes joined by MLX's ring, each
    stepping workers/K vmapped replicas; calling it runs one step in all of them."""

    def __init__(self, model_name, workers, batch_size, seq_len, K, blas_threads):
        from mlx_diloco.training.processes import free_ports
        self.tmp = tempfile.TemporaryDirectory(prefix="bench-throughput-")
        hostfile = Path(self.tmp.name) / "hosts.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(K)]))
        args = [sys.executable, __file__, "--child", model_name, str(workers), str(batch_size), str(seq_len),
                str(workers // K)]
        self.procs = [subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={
            **os.environ, "MLX_RANK": str(r), "MLX_HOSTFILE": str(hostfile),
            "OPENBLAS_NUM_THREADS": str(blas_threads)}) for r in range(K)]
        for p in self.procs:
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a bench process failed to start (exit {p.wait()})")

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
        self.tmp.cleanup()


def best_step_times(setups: dict, rounds: int) -> dict:
    """Round-robin over the setups, one step each per round, keeping each one's best time:
    every setup sees the same machine conditions (this CPU's speed drifts by tens of %)."""
    for run in setups.values():  # warm-up
        run(), run()
    best = {name: float("inf") for name in setups}
    for _ in range(rounds):
        for name, run in setups.items():
            t = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - t)
    return best


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
        best = best_step_times(setups, args.steps)
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
    p.add_argument("--steps", type=int, default=10, help="timed rounds (each setup's best step is kept)")
    p.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8], help="simulated worker counts N")
    p.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4], help="process counts K")
    p.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        model, *numbers = args.child
        return child(model, *map(int, numbers))
    from mlx_diloco.training.processes import usable_cores
    for B in args.batch_size:
        print_table(args, B, usable_cores())


if __name__ == "__main__":
    main()
