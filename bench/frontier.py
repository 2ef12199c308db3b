"""Two of issue 26's comparisons that the scorecards (bench/gym_scorecards.py) do not make.

(a) Quorum rounds on slow-mac-home (4 Macs, one at 0.25 speed): DiLoCo paced fixed (everyone waits
    for the slow Mac) and time (the slow Mac takes a quarter of the steps of a round), and quorum
    rounds (K = 3, the slow Mac's round spans four outer steps and lands stale).
(b) DES-LOC against DiLoCo and Local Adam at equal bytes, on shakespeare-home (4 workers, 500
    steps): each sends 10 model-sized 2-byte exchanges per worker. DiLoCo H=50 fp16: 10 outer
    steps. DES-LOC bf16, Kx=75 (Ku=225, Kv=450, the paper's 3x and 6x): 7 parameter, 2 first-moment
    and 1 second-moment averages. Local Adam bf16, K=150: 4 + 3 + 3.

    .venv/bin/python bench/frontier.py [--out runs/bench/frontier]

Run it again to resume (finished points are kept).
"""

import argparse
import sys
from pathlib import Path

from mlx_diloco.blas import ensure_fast_blas

if __name__ == "__main__":
    ensure_fast_blas([__file__, *sys.argv[1:]])  # Linux: re-run with OpenBLAS preloaded

from mlx_diloco.gym.problems import get_problem
from mlx_diloco.gym.sweep import run_sweep
from mlx_diloco.training.processes import simulate

from cluster_links import doctor_gflops

EQUAL_BYTES = [
    {"strategy": "diloco", "sync_every": 50},
    {"strategy": "desloc", "sync_every": 75, "compress": "bf16"},
    {"strategy": "desloc", "sync_every": 150, "first_moment_sync_every": 150, "second_moment_sync_every": 150,
     "compress": "bf16"},
]
PACING = [
    {"strategy": "diloco", "speed_policy": "fixed"},
    {"strategy": "diloco", "speed_policy": "time"},
    {"strategy": "quorum", "speed_policy": "time"},
]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/bench/frontier")
    args = p.parse_args()
    print(f"# python bench/frontier.py   (doctor: {doctor_gflops()})", flush=True)
    train = lambda config, run_dir, resume: simulate(config, run_dir, resume=resume, log=lambda m: None)  # noqa: E731
    for name, points in [("slow-mac-home", PACING), ("shakespeare-home", EQUAL_BYTES)]:
        problem = get_problem(name)
        out = Path(args.out) / name
        run_sweep(problem.settings(), points, out, problem=problem, train=train, log=lambda m: print(m, flush=True))
        print(f"\n{name}: {problem.about}\n{(out / 'sweep.md').read_text()}", flush=True)


if __name__ == "__main__":
    main()
