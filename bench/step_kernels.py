"""Kernels one inner step launches: the project's step against plain MLX's (bench/mlx_baseline.py),
on a GPU's paths (MLX's fused kernels, bf16 layers multiplying in bf16) on whatever device runs it.

    python bench/step_kernels.py [--model gpt-10m] [--precisions fp32 bf16]

On a GPU every kernel launch costs microseconds whatever its size, so a step that launches more
kernels than plain MLX's is slower by a fixed amount (H200, issue 35: the bf16 step 5-6 ms slower at
gpt-10m and at gpt2-124m alike, fp32 not). The count needs no GPU: MLX fuses a compiled step's
elementwise chains the same way on every device, so this counts the nodes of the compiled step's
graph (mx.export_to_dot) that launch a kernel: every node but the views (reshape, transpose, ...).
"""

import argparse
import io
import re
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from mlx_diloco.models import kernels  # noqa: E402

# Nodes that only describe a view of their input (no kernel on any device, for a contiguous input)
VIEWS = {"Reshape", "Broadcast", "Slice", "Transpose", "ExpandDims", "Squeeze", "AsStrided", "Flatten",
         "Unflatten", "View"}


def launches(outputs) -> Counter:
    """The graph's nodes that launch a kernel, counted by primitive (fused chains as "Compiled")."""
    dot = io.StringIO()
    mx.export_to_dot(dot, *[a for _, a in tree_flatten(outputs)])
    names = re.findall(r'label ="([^"]+)"', dot.getvalue())
    names = ["Compiled" if n.startswith("Compiled") else n.split()[0] for n in names]
    return Counter(n for n in names if n not in VIEWS)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-10m")
    p.add_argument("--precisions", nargs="+", default=["fp32", "bf16"])
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--vmapped", type=int, default=4, help="N: also the step of N vmapped workers of B/N each")
    args = p.parse_args()
    import mlx_baseline
    import throughput
    print(f"# python bench/step_kernels.py {' '.join(sys.argv[1:])}")
    print(f"kernels one step launches, {args.model}, on a GPU's paths (MLX {mx.__version__}, counted on {mx.default_device()})\n")
    N = args.vmapped if args.vmapped > 1 and args.batch_size % args.vmapped == 0 else 0
    vmapped = f"{N} vmapped" if N else ""
    print(f"{'precision':10} {'project':>8} {'plain MLX':>10} {vmapped:>10}   the project's extra kernels, by primitive")
    with kernels.chosen(device="gpu", fused=True, fp32_matmul=False):
        for precision in args.precisions:
            ours = counted(throughput.project_step(args.model, precision, 1, args.batch_size, args.seq_len))
            plain = mlx_baseline.pretraining_step(args.model, precision, args.batch_size, args.seq_len)
            plain()
            theirs = launches(plain.lazy())
            replicas = counted(throughput.project_step(args.model, precision, N, args.batch_size // N, args.seq_len)) if N else None
            extra = ", ".join(f"{k} {v:+d}" for k, v in (ours - theirs).most_common(4))
            print(f"{precision:10} {sum(ours.values()):8} {sum(theirs.values()):10} "
                  f"{sum(replicas.values()) if N else '':>10}   {extra}")


def counted(project_step) -> Counter:
    """The kernels of the project's whole compiled step (compiled from the second step on)."""
    project_step(), project_step()
    return launches(project_step.lazy())


if __name__ == "__main__":
    main()
