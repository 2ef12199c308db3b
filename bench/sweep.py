"""Hyperparameter sweep on the strategy comparison's setting (small GPT, embedded Shakespeare).

    python bench/sweep.py '{"strategy": "diloco", "lr": 3e-3}' '{"strategy": "fedavg", "lr": 2e-3}' ...

Each argument is a JSON object of config keys laid over bench/compare_strategies.py's shared
settings (500 steps, H=50, 4 workers, evaluated every 50 steps). One line per run, printed as it
finishes: the overrides, the final eval loss of the global model and the eval curve.
About 11 minutes per 4-worker run on a 2-core CPU.
"""

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mlx_diloco.blas import ensure_fast_blas  # noqa: E402

if __name__ == "__main__":
    ensure_fast_blas(sys.argv)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="JSON objects of config keys, one per run")
    p.add_argument("--out", default="runs/sweep", help="folder for the runs")
    p.add_argument("--steps", type=int, default=500, help="inner steps per worker")
    p.add_argument("--sync-every", type=int, default=50, help="H (DiLoCo, FedAvg)")
    args = p.parse_args()

    from compare_strategies import comparison_settings, train

    out = Path(args.out)
    common = {**comparison_settings(args.steps, args.sync_every), "workers": 4}
    for i, overrides in enumerate(args.runs):
        run_dir = out / f"run-{i}"
        shutil.rmtree(run_dir, ignore_errors=True)
        start = time.time()
        summary = train({**common, **json.loads(overrides)}, run_dir)
        curve = [round(json.loads(line)["eval_loss"], 3) for line in (run_dir / "metrics.jsonl").open()
                 if json.loads(line).get("eval_loss") is not None]
        print(f"{overrides}\t{summary['final_eval_loss']:.4f}\t{time.time() - start:.0f} s\t{curve}", flush=True)


if __name__ == "__main__":
    main()
