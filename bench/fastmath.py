"""The CPU's attention and loss through powers of two (models/fastmath.py) against MLX's fused
functions (mx.fast's attention, cross-entropy: on a CPU, their op-by-op definitions), on this
machine: one training step of N vmapped workers, interleaved, best of --steps. What
models/kernels.py's choice for the CPU rests on.

    python bench/fastmath.py [--model small] [--workers 4] [--batch-size 16 8] [--seq-len 64]
"""

import argparse
import sys
import time
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
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    from cluster_links import doctor_gflops
    from throughput import project_step
    from mlx_diloco.models import kernels
    print(f"# python bench/fastmath.py {' '.join(sys.argv[1:])}   (doctor: {doctor_gflops()})")

    def on_path(fused, *setup):
        """A step traced (and run) with the kernels `fused` or not."""
        with kernels.chosen(fused=fused):
            step = project_step(*setup)
            step()  # traced on this path

        def run():
            with kernels.chosen(fused=fused):
                step()
        return run

    for B in args.batch_size:
        setup = (args.model, args.precision, args.workers, B, args.seq_len)
        steps = {"fused": on_path(True, *setup), "2**x": on_path(False, *setup)}
        times = {k: [] for k in steps}
        for _ in range(args.steps):
            for k, step in steps.items():
                t = time.perf_counter()
                step()
                times[k].append(time.perf_counter() - t)
        fused, pow2 = min(times["fused"]), min(times["2**x"])
        print(f"{args.model} {args.precision}, {args.workers} workers, B={B}, T={args.seq_len}, one process: "
              f"MLX's fused functions {fused * 1e3:.0f} ms/step, powers of two {pow2 * 1e3:.0f} ms/step "
              f"({fused / pow2:.2f}x)")


if __name__ == "__main__":
    main()
