"""Softmax and cross-entropy through powers of two (models/fastmath.py) against MLX's own, on this
machine: one training step of N vmapped workers of the small GPT, interleaved, best of --steps.

    python bench/fastmath.py [--workers 4] [--batch-size 16]
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_diloco.blas import ensure_fast_blas  # noqa: E402

if __name__ == "__main__":
    ensure_fast_blas(sys.argv)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--batch-size", type=int, nargs="+", default=[16, 8])
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    from throughput import best_step_times, make_setup
    from mlx_diloco.models import fastmath

    def switched(step, on):
        def run():
            fastmath.enabled = on
            return step()
        return run

    for B in args.batch_size:
        setups = {}
        for on in (False, True):  # separate replicas: each compiles its own graph
            fastmath.enabled = on
            setups[on] = switched(make_setup(args.model, args.workers, B, 64), on)
        best = best_step_times(setups, args.steps)
        print(f"{args.model}, {args.workers} workers, B={B}, one process: MLX exp {best[False] * 1e3:.0f} ms/step, "
              f"powers of two {best[True] * 1e3:.0f} ms/step ({best[False] / best[True]:.2f}x)")


if __name__ == "__main__":
    main()
