"""Simulator throughput: what does simulating N workers cost?

    python bench/throughput.py [--model small] [--steps 8]

Measures, side by side in one run, tokens/s of: one worker alone (batch B); one worker with an
N-times larger batch (N*B); the simulator with N workers of batch B, vectorized (mx.vmap) and
sequential. Target: vectorized N workers cost no more than ~5% over one worker with batch N*B.
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_diloco.blas import ensure_fast_blas  # noqa: E402

if __name__ == "__main__":
    ensure_fast_blas(sys.argv)


def make_setup(model_name, workers, batch_size, vectorize, seq_len):
    """A ready-to-step closure training `workers` replicas of batch `batch_size`."""
    import mlx.core as mx
    from mlx_diloco.exchange.comm import SimCommunicator
    from mlx_diloco.config import TrainConfig
    from mlx_diloco.data.datasets import prepare
    from mlx_diloco.models.zoo import build_model, load_spec
    from mlx_diloco.training.workers import Workers

    config = TrainConfig.from_dict(dict(model=model_name, workers=workers, batch_size=batch_size,
                                        seq_len=seq_len, vectorize=vectorize, sync_every=10_000))
    spec = load_spec(model_name)
    data = prepare(config.data, seq_len, spec.vocab_size, log=lambda m: None)
    model = build_model(spec)
    strategy = config.make_strategy().bind(SimCommunicator(workers), config.steps)
    strategy.setup(model.trainable_parameters())
    w = Workers(model, workers, config, strategy.inner_optimizer(config), vectorize=vectorize)
    x, y = (mx.array(a.reshape(workers, batch_size, -1)) for a in data.train.get(range(workers * batch_size)))
    step = iter(range(1, 1 << 30))
    return lambda: w.step(x, y, strategy, next(step))


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


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small", help="model preset")
    p.add_argument("--batch-size", type=int, nargs="+", default=[16, 8],
                   help="B: sequences per worker per step; one table each (16 is the trainer's default)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    p.add_argument("--steps", type=int, default=10, help="timed rounds (each setup's best step is kept)")
    p.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8], help="simulated worker counts")
    args = p.parse_args()
    for B in args.batch_size:
        print_table(args, B)


def print_table(args, B):
    T = args.seq_len
    setups = {(1, B, True): make_setup(args.model, 1, B, True, T)}
    for n in args.workers:
        setups[(1, n * B, True)] = make_setup(args.model, 1, n * B, True, T)
        for vec in (True, False):
            setups[(n, B, vec)] = make_setup(args.model, n, B, vec, T)
    best = best_step_times(setups, args.steps)

    print(f"\nmodel {args.model}, B={B}, T={T}; best of {args.steps} interleaved steps each\n")
    print(f"{'setup':34} {'s/step':>8} {'tokens/s':>10} {'vs 1 worker with N*B':>22}")
    alone = best[(1, B, True)]
    print(f"{'1 worker, batch B':34} {alone:8.3f} {B * T / alone:10,.0f}")
    worst = 0.0
    for n in args.workers:
        big = best[(1, n * B, True)]
        print(f"{f'1 worker, batch {n}*B':34} {big:8.3f} {n * B * T / big:10,.0f} {'1.000':>22}")
        for vec in (True, False):
            t = best[(n, B, vec)]
            label = f"sim {n} workers, {'vectorized' if vec else 'sequential'}"
            print(f"{label:34} {t:8.3f} {n * B * T / t:10,.0f} {t / big:22.3f}")
            if vec:
                worst = max(worst, t / big)
    print(f"B={B}: vectorized simulation costs at most {(worst - 1) * 100:+.1f}% over one worker with "
          f"batch N*B (target ~5%: {'met' if worst <= 1.05 else 'NOT met'})")


if __name__ == "__main__":
    main()
