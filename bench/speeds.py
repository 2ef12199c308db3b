"""Workers of speeds 1 and 0.5: fixed-H rounds against time-paced rounds, at equal wall-clock.

    python bench/speeds.py [--out runs/speeds]

Gym problem mixed-home (small GPT, 2 workers, home internet, 0.05 s per step of the fast worker).
Fixed H: 500 ticks, each as long as the slow worker's step (0.1 s). Time-paced: 1,000 ticks of
0.05 s, the same modelled compute time, in which the slow worker takes 500 steps and the fast one
1,000. Prints each run's final eval loss, tokens and modelled time, and when the time-paced run
first reached the fixed run's final eval loss; writes speeds.png. About 15 minutes on a 2-core CPU.
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
    p.add_argument("--out", default="runs/speeds")
    args = p.parse_args()

    from mlx_diloco.gym.problems import get_problem
    from mlx_diloco.gym.sweep import run_sweep
    from mlx_diloco.training.metrics import MetricsLog
    from mlx_diloco.training.processes import simulate

    problem = get_problem("mixed-home")
    steps = problem.settings()["steps"]
    points = [{"speed_policy": "fixed", "steps": steps}, {"speed_policy": "time", "steps": 2 * steps}]
    fixed, timed = run_sweep(problem.settings(), points, Path(args.out), problem=problem,
                             train=lambda c, d, resume: simulate(c, d, resume=resume, log=lambda m: None))
    for c in (fixed, timed):
        print(f"{c['speed_policy']:6} {c['steps']:5} ticks: eval loss {c['final_eval_loss']:.4f}, "
              f"{c['tokens']:,} tokens, modelled {c['modelled_s']:.1f} s (idle {c['idle_fraction']:.0%})")
    goal = fixed["final_eval_loss"]
    reached = next((r for r in MetricsLog.read(timed["run_dir"]) if r["eval_loss"] <= goal), None)
    print(f"time-paced reached the fixed run's final eval loss {goal:.4f} "
          + (f"at tick {reached['step']}, modelled {reached['modelled_time_s']:.1f} s against "
             f"{fixed['modelled_s']:.1f} s ({reached['modelled_time_s'] / fixed['modelled_s'] - 1:+.0%})"
             if reached else "never"))


if __name__ == "__main__":
    main()
