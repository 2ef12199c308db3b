"""DiLoCo vs data parallel vs a single worker on the embedded Shakespeare corpus.

    python bench/compare_strategies.py [--out runs/compare] [--steps 500]

DiLoCo (4 workers, H=50) and DDP (4 workers) see the same total tokens; the single worker
takes the same number of steps (a quarter of the tokens). Prints final eval losses and the
DiLoCo/DDP ratio, and writes compare.png with the three curves. ~15 min on a 2-core CPU.
"""

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_diloco.blas import ensure_fast_blas  # noqa: E402

if __name__ == "__main__":
    ensure_fast_blas(sys.argv)  # re-run this script with OpenBLAS preloaded (Linux)


def comparison_settings(steps: int, sync_every: int) -> dict:
    """What every run of the comparison shares (bench/sweep.py varies the rest)."""
    return dict(model="small", data="shakespeare", steps=steps, sync_every=sync_every,
                eval_every=sync_every, eval_sequences=256)


def train(settings: dict, run_dir: Path) -> dict:
    """One simulated run; returns its summary."""
    from mlx_diloco.exchange.comm import SimCommunicator
    from mlx_diloco.config import TrainConfig
    from mlx_diloco.training.run import Run

    config = TrainConfig.from_dict(settings)
    return Run(config, run_dir, SimCommunicator(config.workers)).train()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/compare", help="folder for the three runs and the plot")
    p.add_argument("--steps", type=int, default=500, help="inner steps per worker")
    p.add_argument("--workers", type=int, default=4, help="workers for DiLoCo and DDP")
    p.add_argument("--sync-every", type=int, default=50, help="DiLoCo H")
    args = p.parse_args()

    from mlx_diloco.tools.plot import plot_runs

    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    common = comparison_settings(args.steps, args.sync_every)
    setups = {
        "diloco": dict(strategy="diloco", workers=args.workers),
        "ddp": dict(strategy="ddp", workers=args.workers),
        "single": dict(strategy="ddp", workers=1),
    }
    results = {name: train({**common, **setup}, out / name) for name, setup in setups.items()}
    png = plot_runs([out / n for n in setups], out / "compare.png",
                    title=f"small GPT on Shakespeare, {args.steps} steps per worker")
    print(f"\n{'run':8} {'workers':>7} {'tokens':>11} {'eval loss':>10} {'sent/worker':>12}")
    for name, s in results.items():
        print(f"{name:8} {s['workers']:>7} {s['tokens']:>11,} {s['final_eval_loss']:>10.4f} "
              f"{s['bytes_sent_per_worker'] / 1e6:>10.1f} MB")
    ratio = results["diloco"]["final_eval_loss"] / results["ddp"]["final_eval_loss"]
    print(f"DiLoCo / DDP eval loss: {ratio:.4f} ({(ratio - 1) * 100:+.2f}%; target: within 3%: "
          f"{'met' if ratio <= 1.03 else 'NOT met'})")
    print(f"single - DiLoCo eval loss: {results['single']['final_eval_loss'] - results['diloco']['final_eval_loss']:+.4f}")
    print(f"plot: {png}")


if __name__ == "__main__":
    main()
