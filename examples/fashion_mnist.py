"""EXO Gym's first example: a CNN on Fashion-MNIST trained by one worker and by two (DiLoCo,
H = 50, Thunderbolt): the inner steps each needs to reach an eval loss target, and the curves.

    .venv/bin/python examples/fashion_mnist.py [--steps 500] [--target 0.45] [--out runs/examples/fashion-mnist]

Fashion-MNIST is found as `--data fashion-mnist` finds it (docs/gym.md: "Fashion-MNIST").
About 2 minutes on a 2-core CPU.
"""

import argparse
import sys
from pathlib import Path

from mlx_diloco.blas import ensure_fast_blas

if __name__ == "__main__":
    ensure_fast_blas([__file__, *sys.argv[1:]])  # Linux: re-run with OpenBLAS preloaded

from mlx_diloco.gym.problems import get_problem
from mlx_diloco.gym.sweep import run_sweep
from mlx_diloco.tools.plot import plot_runs
from mlx_diloco.training.processes import simulate


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=500, help="inner steps per worker")
    p.add_argument("--target", type=float, default=0.45, help="eval loss to reach")
    p.add_argument("--out", default="runs/examples/fashion-mnist")
    args = p.parse_args()

    base = {**get_problem("fashion-thunderbolt").settings(), "steps": args.steps, "eval_every": 25}
    cards = run_sweep(base, [{"workers": 1}, {"workers": 2}], Path(args.out), target_loss=args.target,
                      train=lambda config, run_dir, resume: simulate(config, run_dir, resume=resume, log=lambda m: None))
    for c in cards:
        reached = f"step {c['steps_to_target']}" if c["steps_to_target"] else "not reached"
        print(f"{c['workers']} worker(s): eval loss {args.target} at {reached}; final {c['final_eval_loss']:.4f}")
    png = plot_runs([c["run_dir"] for c in cards], Path(args.out) / "fashion-mnist.png",
                    title=f"CNN on Fashion-MNIST, DiLoCo H=50: 1 and 2 workers (target {args.target})")
    print(f"plot: {png}")


if __name__ == "__main__":
    main()
