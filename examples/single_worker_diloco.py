"""EXO Gym's second example: one worker, DiLoCo with H = 50 and H = 500 against plain AdamW
(the same worker, the same inner steps and data), the small GPT on Shakespeare.

    .venv/bin/python examples/single_worker_diloco.py [--steps 2000] [--out runs/examples/single-worker]

DiLoCo with one worker is AdamW plus an outer Nesterov step every H steps (a lookahead). The
DiLoCo paper finds it ahead of AdamW; docs/gym.md's "The papers' claims" says where that holds here.
About 5 minutes per run of 2,000 steps on a 2-core CPU.
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
    p.add_argument("--steps", type=int, default=2000, help="inner steps")
    p.add_argument("--out", default="runs/examples/single-worker")
    args = p.parse_args()

    problem = get_problem("shakespeare-home")
    base = {**problem.settings(), "workers": 1, "steps": args.steps, "eval_every": 50}
    points = [{"strategy": "ddp"},  # one worker: plain AdamW
              {"strategy": "diloco", "sync_every": 50}, {"strategy": "diloco", "sync_every": 500}]
    cards = run_sweep(base, points, Path(args.out), problem=problem,
                      train=lambda config, run_dir, resume: simulate(config, run_dir, resume=resume, log=lambda m: None))
    for c in cards:
        print(f"{'AdamW' if c['strategy'] == 'ddp' else c['label']:16} final eval loss {c['final_eval_loss']:.4f}")
    png = plot_runs([c["run_dir"] for c in cards], Path(args.out) / "single-worker.png",
                    title=f"one worker, {args.steps} steps: AdamW and DiLoCo (H = 50, 500)")
    print(f"plot: {png}")


if __name__ == "__main__":
    main()
