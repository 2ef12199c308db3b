"""EXO Gym's third example: DiLoCo with 1, 2, 4 and 8 workers, H = 10 and 50, the small GPT on
Shakespeare (gym problem shakespeare-home), each worker taking the same inner steps on its own
shard: more workers, more tokens. DDP with the same workers and tokens is the reference.

    .venv/bin/python examples/diloco_workers.py [--steps 500] [--out runs/examples/workers]

About 40 minutes on a 2-core CPU (the 8-worker runs are most of it); run it again to resume. The
DiLoCo part is `mlx-diloco sweep --problem shakespeare-home --grid workers=1,2,4,8 --grid
sync_every=10,50` (docs/gym.md: "Sweeps").
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


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=500, help="inner steps per worker")
    p.add_argument("--out", default="runs/examples/workers")
    args = p.parse_args()

    problem = get_problem("shakespeare-home")
    base = {**problem.settings(), "steps": args.steps}
    workers = (1, 2, 4, 8)
    points = ([{"strategy": "diloco", "workers": m, "sync_every": h} for m in workers for h in (10, 50)]
              + [{"strategy": "ddp", "workers": m} for m in workers])
    cards = run_sweep(base, points, Path(args.out), problem=problem,
                      train=lambda config, run_dir, resume: simulate(config, run_dir, resume=resume, log=lambda m: None))
    ddp = {c["workers"]: c["final_eval_loss"] for c in cards if c["strategy"] == "ddp"}
    for c in cards:
        if c["strategy"] == "diloco":
            gap = c["final_eval_loss"] / ddp[c["workers"]] - 1
            print(f"DiLoCo x{c['workers']} H={c['point']['sync_every']}: eval loss {c['final_eval_loss']:.4f}, DDP {ddp[c['workers']]:.4f} ({gap:+.1%})")
    print(f"table: {Path(args.out) / 'sweep.md'}, plots: {Path(args.out) / 'sweep.png'}")


if __name__ == "__main__":
    main()
