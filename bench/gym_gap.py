"""What users see (issue 44): the default `sim` and the gym's language-model problems, DiLoCo against
DDP with the same workers at the same tokens, with the outer step before the fitted rule (outer lr
0.6, momentum 0.9: e5146bc's defaults) and with it (`--outer-lr auto --outer-momentum auto`, today's
defaults).

    .venv/bin/python bench/gym_gap.py [--out runs/bench/gym-gap]      (resumes when run again)

Each problem's own settings (mlx_diloco/gym/problems.py: model, data, workers, steps, batch, link);
the default sim is `mlx-diloco sim` as it runs with no flags. One run at a time, one process each.
Prints a table and writes gym-gap.md to --out.
"""

import argparse
import json
import sys
from pathlib import Path

from mlx_diloco.blas import ensure_fast_blas

if __name__ == "__main__":
    ensure_fast_blas([__file__, *sys.argv[1:]])  # Linux: re-run with OpenBLAS preloaded

BEFORE = {"outer_lr": 0.6, "outer_momentum": 0.9}       # e5146bc: auto was 0.6 at every M and H; momentum 0.9
PROBLEMS = ("default sim", "shakespeare-home", "gpt-wifi-8", "mixed-home")


def settings(problem: str, strategy: str) -> dict:
    """The problem's config for `strategy` (the default sim: sim's defaults, 500 steps of 4 workers)."""
    from mlx_diloco.gym.problems import get_problem
    if problem == "default sim":
        return {"strategy": strategy}  # TrainConfig's defaults: what `sim` trains with no flags
    return {**get_problem(problem).prepared(log=lambda m: None, strategy=strategy), "strategy": strategy}


def train(config: dict, run_dir: str) -> dict:
    """One run in a pool's process: its summary (resumed if cut off)."""
    from mlx_diloco.config import TrainConfig
    from mlx_diloco.run_folder import latest_step
    from mlx_diloco.training.processes import simulate
    summary = Path(run_dir) / "summary.json"
    if not summary.exists():
        simulate(TrainConfig.from_dict(config), Path(run_dir), processes=1,
                 resume=latest_step(run_dir) is not None, log=lambda m: None)
    return json.loads(summary.read_text())


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/bench/gym-gap")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context
    pool = ProcessPoolExecutor(1, mp_context=get_context("spawn"))
    rows = ["| problem | workers, steps, H | DDP | DiLoCo before (0.6 / 0.9) | gap | DiLoCo now (auto) | gap | "
            "outer lr / momentum now |", "|---|---|---|---|---|---|---|---|"]
    for problem in PROBLEMS:
        runs = {}
        for label, strategy, extra in (("ddp", "ddp", {}), ("before", "diloco", BEFORE), ("now", "diloco", {})):
            config = {**settings(problem, strategy), **extra}
            folder = out / problem.replace(" ", "-") / label
            runs[label] = pool.submit(train, config, str(folder)).result()
            print(f"  {problem} {label}: {runs[label]['final_eval_loss']:.4f}", flush=True)
        ddp, before, now = (runs[k]["final_eval_loss"] for k in ("ddp", "before", "now"))
        saved = json.loads((out / problem.replace(" ", "-") / "now" / "config.json").read_text())
        rows.append(f"| {problem} | {saved['workers']}, {saved['steps']}, {saved.get('sync_every')} | {ddp:.4f} | "
                    f"{before:.4f} | {before / ddp - 1:+.1%} | {now:.4f} | {now / ddp - 1:+.1%} | "
                    f"{saved.get('outer_lr')} / {saved.get('outer_momentum')} |")
    text = "\n".join(rows)
    print(text)
    (out / "gym-gap.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
