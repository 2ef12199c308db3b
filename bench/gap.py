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


def setting(card: dict) -> tuple:
    """The (model, steps, workers) a card's run belongs to."""
    return card["point"]["model"], card["point"]["steps"], card["point"]["workers"]


def pairs(cards: list) -> list:
    """(DDP card, DiLoCo card) for each setting that has both."""
    ddp = {setting(c): c for c in cards if c["strategy"] == "ddp"}
    return [(ddp[setting(c)], c) for c in cards if c["strategy"] == "diloco" and setting(c) in ddp]


def gap_table(cards: list) -> str:
    rows = ["| model | steps | workers | DDP (AdamW at M=1) | DiLoCo H=50 | gap | sent/worker DiLoCo / DDP |",
            "|---|---|---|---|---|---|---|"]
    for d, c in pairs(cards):
        model, steps, workers = setting(c)
        extra = "" if c["point"].get("outer_lr") is None else f" (lr {c['point']['outer_lr']}, mom {c['point']['outer_momentum']})"
        rows.append(f"| {model} | {steps:,} | {workers} | {d['final_eval_loss']:.4f} | "
                    f"{c['final_eval_loss']:.4f}{extra} | {c['final_eval_loss'] / d['final_eval_loss'] - 1:+.1%} | "
                    f"{c['bytes_sent_per_worker'] / 1e6:.1f} MB / {d['bytes_sent_per_worker'] / 1e6:.0f} MB |")
    return "\n".join(rows)


def gap_plot(cards: list, out: Path) -> Path:
    """A panel per setting: DDP's and DiLoCo's eval loss against the tokens all workers read."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from mlx_diloco.tools.plot import loss_curves, save_figure
    from mlx_diloco.training.metrics import MetricsLog

    both = pairs(cards)
    fig, axes = plt.subplots(1, len(both), figsize=(4 * len(both), 3.6), squeeze=False)
    for ax, (d, c) in zip(axes[0], both):
        curves = [(name, MetricsLog.read(card["run_dir"])[1:])  # from the first evaluation after step 0
                  for card, name in ((d, "AdamW" if setting(d)[2] == 1 else "DDP"), (c, "DiLoCo H=50"))]
        loss_curves(ax, curves, "tokens", "tokens (all workers)")
        model, steps, workers = setting(c)
        ax.set_title(f"{model}, {steps:,} steps, M={workers}: {c['final_eval_loss'] / d['final_eval_loss'] - 1:+.1%}")
        ax.set_ylabel("eval loss")
        ax.legend(fontsize=8)
    return save_figure(fig, out, "DiLoCo's gap to DDP by model and steps (losses compare within a panel)")


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
    print(f"plot: {gap_plot(cards, Path(args.out) / 'gap.png')}")


if __name__ == "__main__":
    main()
