"""DiLoCo's gap to DDP at scale (issue 26): does it close with steps and model size, as the
scaling-law paper (arXiv 2503.09799) reports? The same M = 4 comparison as docs/gym.md's table
(gym problem shakespeare-home: every worker its own 16 x 64-token batch, DiLoCo H = 50, outer lr 0.7,
momentum 0.9; DDP averages the same 4 batches every step) at the tiny, small and gpt-10m presets
(500 steps) and at 2,000 steps (small); and single-worker DiLoCo at 2,000 steps with the outer
momentum that won at 500 (lr 0.5, momentum 0.7) beside plain AdamW.

    .venv/bin/python bench/gap.py [--out runs/bench/gap]

Run it again to resume (finished points are kept). Cheapest first, so a partial run still answers
part of the question. gpt-10m keeps 64-token sequences (its context is 256), so that it sees the
same tokens per step as small: what changes is the model (tiny's context is 32 tokens).
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

TUNED_SINGLE = {"outer_lr": 0.5, "outer_momentum": 0.7}  # docs/gym.md (a): the best at 500 steps


def points() -> list:
    """(model, steps, workers) settings, each with DDP (or AdamW, M = 1) and DiLoCo beside it."""
    pairs = []
    for model, steps, workers, diloco in [("tiny", 500, 4, {}), ("small", 500, 4, {}), ("small", 2000, 1, TUNED_SINGLE),
                                          ("small", 2000, 4, {}), ("gpt-10m", 500, 4, {})]:
        shared = {"model": model, "steps": steps, "workers": workers, "seq_len": 32 if model == "tiny" else 64}
        pairs += [{**shared, "strategy": "ddp"}, {**shared, "strategy": "diloco", "sync_every": 50, **diloco}]
    return pairs


def gap_table(cards: list) -> str:
    rows = ["| model | steps | workers | DDP (AdamW at M=1) | DiLoCo H=50 | gap | sent/worker DiLoCo / DDP |",
            "|---|---|---|---|---|---|---|"]
    key = lambda c: (c["point"]["model"], c["point"]["steps"], c["point"]["workers"])  # noqa: E731
    ddp = {key(c): c for c in cards if c["strategy"] == "ddp"}
    for c in cards:
        if c["strategy"] == "diloco" and key(c) in ddp:
            d = ddp[key(c)]
            extra = "" if c["point"].get("outer_lr") is None else f" (lr {c['point']['outer_lr']}, mom {c['point']['outer_momentum']})"
            rows.append(f"| {key(c)[0]} | {key(c)[1]:,} | {key(c)[2]} | {d['final_eval_loss']:.4f} | "
                        f"{c['final_eval_loss']:.4f}{extra} | {c['final_eval_loss'] / d['final_eval_loss'] - 1:+.1%} | "
                        f"{c['bytes_sent_per_worker'] / 1e6:.1f} MB / {d['bytes_sent_per_worker'] / 1e6:.0f} MB |")
    return "\n".join(rows)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/bench/gap")
    args = p.parse_args()
    print(f"# python bench/gap.py   (doctor: {doctor_gflops()})", flush=True)
    problem = get_problem("shakespeare-home")
    cards = run_sweep(problem.settings(), points(), Path(args.out), problem=problem,
                      train=lambda config, run_dir, resume: simulate(config, run_dir, resume=resume, log=lambda m: None),
                      log=lambda m: print(m, flush=True))
    table = gap_table(cards)
    (Path(args.out) / "gap.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
