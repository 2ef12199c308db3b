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


def seconds_per_step(model_name, workers, batch_size, vectorize, steps, seq_len):
    import mlx.core as mx
    from mlx_diloco.comm import SimCommunicator
    from mlx_diloco.config import TrainConfig
    from mlx_diloco.data import prepare
    from mlx_diloco.modelzoo import build_model, load_spec
    from mlx_diloco.strategies import make_strategy
    from mlx_diloco.workers import Workers

    config = TrainConfig.from_dict(dict(model=model_name, workers=workers, batch_size=batch_size,
                                        seq_len=seq_len, vectorize=vectorize, sync_every=10_000))
    spec = load_spec(model_name)
    data = prepare(config.data, seq_len, spec.vocab_size, log=lambda m: None)
    model = build_model(spec)
    strategy = make_strategy(SimCommunicator(workers), config)
    strategy.setup(model.trainable_parameters())
    w = Workers(model, workers, config, vectorize=vectorize)
    idx = list(range(workers * batch_size))
    x, y = (mx.array(a.reshape(workers, batch_size, -1)) for a in data.train.get(idx))
    for step in range(1, 3):  # warm-up
        w.step(x, y, strategy, step)
    best = float("inf")
    for step in range(3, 3 + steps):
        t = time.perf_counter()
        w.step(x, y, strategy, step)
        best = min(best, time.perf_counter() - t)
    return best


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small", help="model preset")
    p.add_argument("--batch-size", type=int, default=8, help="B: sequences per worker per step")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    p.add_argument("--steps", type=int, default=8, help="timed steps per setup (the best is kept)")
    p.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8], help="simulated worker counts")
    args = p.parse_args()

    B, T = args.batch_size, args.seq_len
    measure = lambda n, b, vec: seconds_per_step(args.model, n, b, vec, args.steps, T)
    alone = measure(1, B, True)
    print(f"model {args.model}, B={B}, T={T}; best of {args.steps} steps each\n")
    print(f"{'setup':34} {'s/step':>8} {'tokens/s':>10} {'vs 1 worker with N*B':>22}")
    print(f"{'1 worker, batch B':34} {alone:8.3f} {B * T / alone:10,.0f}")
    for n in args.workers:
        big = measure(1, n * B, True)
        print(f"{f'1 worker, batch {n}*B':34} {big:8.3f} {n * B * T / big:10,.0f} {'1.000':>22}")
        for vec in (True, False):
            t = measure(n, B, vec)
            label = f"sim {n} workers, {'vectorized' if vec else 'sequential'}"
            print(f"{label:34} {t:8.3f} {n * B * T / t:10,.0f} {t / big:22.3f}")


if __name__ == "__main__":
    main()
