"""Where the project's bf16 peak memory goes on this device: one worker's step (--moments-precision
bf16, as plain MLX keeps AdamW's moments) with its device paths switched, beside plain MLX's step.
Each in its own process (MLX's peak is per process), 4 steps; MLX's peak and, after the steps, its
active memory (what stays held: weights, moments, DiLoCo's fp32 global model).

    python bench/bf16_memory.py [--model small] [--batch-size 16] [--seq-len 64]
"""

import argparse
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

# the paths switched (models/kernels.py): the device's own, bf16 layers multiplied in bf16, MLX's fused kernels
VARIANTS = {"plain MLX": None, "project as is": {}, "bf16 layers multiplied in bf16": {"fp32_matmul": False},
            "MLX's fused kernels": {"fused": True}, "fused, bf16 matmuls": {"fused": True, "fp32_matmul": False}}


def one(variant: str, model: str, batch_size: int, seq_len: int):
    import mlx.core as mx
    if VARIANTS[variant] is None:
        from mlx_baseline import pretraining_step
        step = pretraining_step(model, "bf16", batch_size, seq_len)
    else:
        from mlx_diloco.models import kernels
        paths = kernels.chosen(**VARIANTS[variant])  # for the whole process (held: a dropped one restores them)
        paths.__enter__()
        from throughput import project_step
        step = project_step(model, "bf16", 1, batch_size, seq_len, variant="bf16 moments")
    for _ in range(4):
        step()
    print(f"{variant:32} peak {mx.get_peak_memory() / 1e6:7.1f} MB   active {mx.get_active_memory() / 1e6:7.1f} MB",
          flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--variant", choices=list(VARIANTS), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.variant:
        return one(args.variant, args.model, args.batch_size, args.seq_len)
    for variant in VARIANTS:
        subprocess.run([sys.executable, __file__, "--model", args.model, "--batch-size", str(args.batch_size),
                        "--seq-len", str(args.seq_len), "--variant", variant], check=True)


if __name__ == "__main__":
    main()
