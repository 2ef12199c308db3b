"""Table 4 of "Scaling Laws for DiLoCo" (Charles et al., arXiv 2503.09799) the paper's way, at `tiny`:
DiLoCo's eval loss at M = 1, 2, 4, 8 replicas against data-parallel (DP), every cell tuned.

    .venv/bin/python bench/scaling_table.py [--out runs/bench/scaling]     (resumes when run again)

The recipe is the paper's (bench/tiny_recipe.py): 20 tokens per parameter, H = 30, outer Nesterov
momentum 0.9, AdamW 0.9/0.99, weight decay 1/T, warmup then cosine to 5%, clipping 1.0. As the paper
takes each cell as the best over inner lr, global batch and outer lr, so here:
  DP:     the inner lr on a sqrt(2) grid, walked until the best is interior, at global batches 8-64,
          halved or doubled while the best batch is at an end;
  M:      at DP's best batch B*, 2B* and 4B* (each replica B/M): the inner lr walked at outer lr 0.6,
          then the outer lr over the paper's grid {0.2, ..., 1.0} (one step past an end where the best
          is there) at that inner lr, then the inner lr again at the best outer lr;
  rule:   beyond the paper, the outer lr and momentum that `--outer-lr auto --outer-momentum auto`
          choose (strategies/outer_lr.py), the inner lr walked at B* and 2B*.
The winning cells run again with a second seed (with evaluations along the way, for the curves);
the spread is printed. Every run evaluates the same first 2,048 held-out sequences (64K tokens).
The gaps are compared with the paper's power laws (its Table 7) extrapolated to tiny's 42K
parameters, not with its 35M row. One run at a time, each in its own process.
Prints the table and writes scaling.md, scaling.png and runs.json to --out.
"""

import argparse
import math
import sys
import time
from pathlib import Path

from mlx_diloco.blas import ensure_fast_blas

if __name__ == "__main__":
    ensure_fast_blas([__file__, *sys.argv[1:]])  # Linux: re-run with OpenBLAS preloaded

from tiny_recipe import (EVAL_SEQUENCES, MODEL, PARAMETERS, SEQ, TOKENS_PER_PARAMETER, Runs,  # noqa: E402
                         diloco_config, dp_config, steps_for, walk_values)

H = 30
MU = 0.9                                               # the paper's outer momentum: the faithful cells
REPLICAS = (1, 2, 4, 8)
BATCHES = (8, 16, 32, 64)                              # global batches DP is tried at (sequences)
INNER_LRS = (1e-3, 1.4e-3, 2e-3, 2.8e-3, 4e-3, 5.7e-3, 8e-3, 1.13e-2, 1.6e-2, 2.26e-2, 3.2e-2, 4.5e-2)
OUTER_LRS = (0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.2)      # the paper's grid and one step past each end
SECOND_SEED = 1
PAPER = {"35M": (-0.1, 0.7, 2.0, 3.9), "90M": (-0.1, 0.5, 1.5, 3.1), "180M": (-0.2, 0.3, 1.1, 2.3)}
LAW_AT_TINY = (0.4, 1.8, 4.6, 8.4)                     # the paper's laws at 42K parameters (REFERENCE.md)
COLOURS = {0: "black", 1: "tab:blue", 2: "tab:orange", 4: "tab:green", 8: "tab:red"}  # per M, every panel


def near(lr: float) -> float:
    """The grid's inner lr nearest `lr` (in log)."""
    return min(INNER_LRS, key=lambda x: abs(math.log(x / lr)))


def steps(batch: int) -> int:
    return steps_for(TOKENS_PER_PARAMETER, batch)


def tune_dp(runs: Runs) -> dict:
    """DP's best over inner lr and global batch (each batch's lr walk starts from 8e-3 x sqrt(B/16)),
    the batches extended by halving or doubling while the best is at an end (the first sweep found
    DP best at 8, the smallest of BATCHES)."""
    batches = list(BATCHES)
    while True:
        for batch in batches:  # (runs already made are read back, not run again)
            walk_values(lambda lr: runs.loss(dp_config(steps(batch), lr, batch)), INNER_LRS,
                        near(8e-3 * (batch / 16) ** 0.5))
        best = runs.best(lambda c: c["strategy"] == "ddp" and c["seed"] == 0 and c["batch_size"] in batches)
        if best["batch_size"] == batches[0] and batches[0] > 2:
            batches.insert(0, batches[0] // 2)
        elif best["batch_size"] == batches[-1]:
            batches.append(batches[-1] * 2)
        else:
            return best


def tune_faithful(runs: Runs, M: int, batch: int, lr0: float) -> dict:
    """The best at (M, batch), momentum 0.9: inner lr at outer 0.6, outer lr, inner lr again."""
    run = lambda lr, outer: runs.loss(diloco_config(M, H, steps(batch), lr, outer, MU, batch))  # noqa: E731
    inner = walk_values(lambda lr: run(lr, 0.6), INNER_LRS, near(lr0))
    lr = min(inner, key=inner.get)
    outer = walk_values(lambda o: run(lr, o), OUTER_LRS, 0.6)
    walk_values(lambda x: run(x, min(outer, key=outer.get)), INNER_LRS, lr)
    return runs.best(lambda c: cell(c, M, batch) and c["outer_momentum"] == MU)


def tune_rule(runs: Runs, M: int, batch: int, lr0: float) -> dict:
    """The best at (M, batch) with the outer lr and momentum of the rule: the inner lr walked."""
    from mlx_diloco.strategies.outer_lr import auto_outer
    outer, mu = auto_outer(M, H, steps(batch))
    walk_values(lambda lr: runs.loss(diloco_config(M, H, steps(batch), lr, outer, mu, batch)), INNER_LRS, near(lr0))
    return runs.best(lambda c: cell(c, M, batch) and (c["outer_lr"], c["outer_momentum"]) == (outer, mu))


def cell(c: dict, M: int, batch: int) -> bool:
    return c["strategy"] == "diloco" and c["workers"] == M and c["batch_size"] * M == batch and c["seed"] == 0


def second_seed(runs: Runs, best: dict) -> dict:
    """`best` again with the second seed, evaluated ten times along the way (the curves)."""
    config = {**{k: v for k, v in best.items() if k not in ("loss", "name")}, "seed": SECOND_SEED,
              "eval_every": best["steps"] // 10}
    runs.loss(config)
    return runs.best(lambda c: c == config)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/bench/scaling")
    args = p.parse_args()
    runs, start = Runs(args.out), time.time()
    print(f"# python bench/scaling_table.py: {MODEL}, {PARAMETERS:,} parameters, "
          f"{TOKENS_PER_PARAMETER} tokens per parameter, H = {H}", flush=True)
    dp = tune_dp(runs)
    B = dp["batch_size"]
    faithful, rule = {}, {}
    for M in REPLICAS:
        batches = [b for b in (B, 2 * B, 4 * B) if b % M == 0]
        faithful[M] = min((tune_faithful(runs, M, b, dp["lr"] * (b / B) ** 0.5) for b in batches),
                          key=lambda r: r["loss"])
        rule[M] = min((tune_rule(runs, M, b, dp["lr"] * (b / B) ** 0.5) for b in batches[:2]),
                      key=lambda r: r["loss"])
    seeds = {"dp": second_seed(runs, dp), **{("faithful", M): second_seed(runs, faithful[M]) for M in REPLICAS},
             **{("rule", M): second_seed(runs, rule[M]) for M in REPLICAS}}
    text = table(dp, faithful, rule, seeds)
    print(text)
    print(f"\n{len(runs.configs)} runs; {time.time() - start:.0f} s this invocation")
    Path(args.out, "scaling.md").write_text(text + "\n")
    print(f"plot: {plot(runs, dp, faithful, rule, seeds, Path(args.out))}")


def gap(loss: float, dp: float) -> str:
    return f"{loss / dp - 1:+.1%}"


def table(dp: dict, faithful: dict, rule: dict, seeds: dict) -> str:
    d0, d1 = dp["loss"], seeds["dp"]["loss"]
    rows = [f"{MODEL} ({PARAMETERS:,} parameters), {TOKENS_PER_PARAMETER} tokens per parameter, H = {H}; "
            f"eval on the first {EVAL_SEQUENCES:,} held-out sequences ({EVAL_SEQUENCES * SEQ // 1000}K tokens). "
            "Each cell: the best over inner lr, global batch and outer lr; in brackets the gap with the "
            f"second seed (seed {SECOND_SEED}) against DP's second seed.",
            "", "| | DP | M = 1 | M = 2 | M = 4 | M = 8 |", "|---|---|---|---|---|---|"]

    def row(label: str, cells: dict, key) -> str:
        return f"| {label} | {d0:.4f} | " + " | ".join(
            f"{cells[M]['loss']:.4f} ({gap(cells[M]['loss'], d0)}; {gap(seeds[(key, M)]['loss'], d1)})"
            for M in REPLICAS) + " |"
    rows.append(row("faithful (momentum 0.9)", faithful, "faithful"))
    rows.append("| its global batch, inner lr, outer lr | " + f"{dp['batch_size']}, {dp['lr']:g} | " + " | ".join(
        f"{faithful[M]['batch_size'] * M}, {faithful[M]['lr']:g}, {faithful[M]['outer_lr']:g}" for M in REPLICAS) + " |")
    rows.append(row("rule (auto outer lr and momentum)", rule, "rule"))
    rows.append("| its global batch, inner lr, outer lr / momentum | | " + " | ".join(
        f"{rule[M]['batch_size'] * M}, {rule[M]['lr']:g}, {rule[M]['outer_lr']:g} / {rule[M]['outer_momentum']:g}"
        for M in REPLICAS) + " |")
    rows.append("| the paper's laws at 42K parameters | | " + " | ".join(f"+{g:.1f}%" for g in LAW_AT_TINY) + " |")
    for size, gaps in PAPER.items():
        rows.append(f"| paper, {size} | | " + " | ".join(f"{g:+.1f}%" for g in gaps) + " |")
    rows.append(f"\nDP's second seed: {d1:.4f} ({gap(d1, d0)} from the first).")
    return "\n".join(rows)


def plot(runs: Runs, dp: dict, faithful: dict, rule: dict, seeds: dict, out: Path) -> Path:
    """Left: the faithful cells' eval loss against the outer lr (at each M's best batch and inner lr),
    DP as a level. Right: eval loss against tokens of the second seeds, DP and each M (faithful solid,
    rule dashed). One colour per M in both panels."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from mlx_diloco.tools.plot import save_figure
    from mlx_diloco.training.metrics import MetricsLog

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for M in REPLICAS:
        f = faithful[M]
        by_outer = sorted((c["outer_lr"], runs.losses[k]) for k, c in runs.configs.items()
                          if cell(c, M, f["batch_size"] * M) and c["outer_momentum"] == MU and c["lr"] == f["lr"])
        left.plot(*zip(*by_outer), marker="o", color=COLOURS[M], label=f"M={M} (batch {f['batch_size'] * M}, lr {f['lr']:g})")
    left.axhline(dp["loss"], color=COLOURS[0], linewidth=1, label=f"DP (batch {dp['batch_size']}, lr {dp['lr']:g})")
    left.set_xlabel("outer lr (momentum 0.9)")
    left.set_ylabel("final eval loss")
    left.grid(alpha=0.3)
    left.legend(fontsize=7)
    for key, style in [("dp", "-"), *((("faithful", M), "-") for M in REPLICAS), *((("rule", M), "--") for M in REPLICAS)]:
        rows = MetricsLog.read(runs.out / seeds[key]["name"])[1:]
        M = 0 if key == "dp" else key[1]
        label = "DP" if key == "dp" else f"M={M}, {key[0]}"
        right.plot([r["tokens"] / 1e6 for r in rows], [r["eval_loss"] for r in rows], style, color=COLOURS[M],
                   marker=".", label=label)
    right.set_xlabel("tokens (millions)")
    right.set_ylabel("eval loss (second seed)")
    right.grid(alpha=0.3)
    right.legend(fontsize=7, ncol=2)
    return save_figure(fig, out / "scaling.png", "DiLoCo against DP at 20 tokens per parameter (tiny), every cell tuned")


if __name__ == "__main__":
    main()
