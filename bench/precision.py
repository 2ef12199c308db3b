"""Simulator throughput by precision and checkpointing: what bf16 and --grad-checkpoint cost here.

    python bench/precision.py [--model small] [--workers 4] [--steps 8]

Side by side in one run (round-robin, one inner step of each setup per round, each setup's best
step kept): tokens/s of N simulated workers in one process, fp32 and bf16, each with and without
activation checkpointing, and the ratio to fp32. On the CPU bf16 is expected to be slower (MLX's
CPU multiplies in fp32 and converts around it); on Apple GPUs it is the fast path.
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_diloco.blas import ensure_fast_blas  # noqa: E402

if __name__ == "__main__":
    ensure_fast_blas(sys.argv)

SETUPS = {"fp32": {}, "bf16": dict(precision="bf16"), "fp32 checkpointed": dict(grad_checkpoint=True),
          "bf16 checkpointed": dict(precision="bf16", grad_checkpoint=True)}


def main():
    from mlx_diloco.config import TrainConfig
    from mlx_diloco.exchange.comm import SimCommunicator
    from mlx_diloco.training.run import Run
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--steps", type=int, default=8, help="timed rounds (each setup's best step is kept)")
    args = p.parse_args()
    runs = {}
    for name, options in SETUPS.items():
        config = TrainConfig.from_dict(dict(model=args.model, workers=args.workers, sync_every=10_000, **options))
        run = Run(config, tempfile.mkdtemp() + "/r", SimCommunicator(args.workers), log=lambda m: None)
        runs[name] = run, run.next_batch()
    best = dict.fromkeys(runs, float("inf"))
    for step in range(1, args.steps + 2):
        for name, (run, (x, y)) in runs.items():
            t = time.perf_counter()
            run.step((x, y))  # the same batch every time
            if step > 1:  # the first step compiles and creates the moments
                best[name] = min(best[name], time.perf_counter() - t)
    config = runs["fp32"][0].config
    tokens = args.workers * config.batch_size * config.seq_len
    print(f"{args.model}, {args.workers} workers x batch {config.batch_size} x {config.seq_len} tokens, one process")
    for name, seconds in best.items():
        print(f"  {name:18} {tokens / seconds:9,.0f} tokens/s   {best['fp32'] / seconds:.2f}x fp32")


if __name__ == "__main__":
    main()
