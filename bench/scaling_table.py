"""Table 4 of "Scaling Laws for DiLoCo" (Charles et al., arXiv 2503.09799) at this CPU's scale
(issue 39): DiLoCo's eval loss at M = 1, 2, 4, 8 replicas against data-parallel, in the paper's
recipe, with the outer learning rate swept per M.

The recipe (the paper's section 3): D = 20 tokens per parameter; the global batch B fixed, each of
M replicas taking B/M; H = 30; outer Nesterov momentum 0.9, the outer lr from
{0.2, 0.4, 0.6, 0.8, 1.0}; AdamW betas 0.9 / 0.99, weight decay 1/T, warmup then cosine to 5% of
the peak lr, inner clipping 1.0. DP is AdamW on the whole batch B (one worker: what data-parallel
computes, the gradient clipped as one). The paper takes each cell as the best over inner lr, batch
and outer lr. Here, on 2 shared cores (docs/results.md says what it cost): the batch is fixed; DP's
inner lr is swept on a factor-2 grid; DiLoCo's outer lr is swept at one inner lr (LR) over the part
of the paper's grid around each M's optimum (GRID); then H = 50 around M = 4's best outer lr at
H = 30 (the rise with H that `--outer-lr auto` extrapolates: strategies/outer_lr.py), and the inner
lr 2 LR at each M's best outer lr.

    .venv/bin/python bench/scaling_table.py [--out runs/bench/scaling] [--parallel 2]

Runs go `--parallel` at a time, one process each; run it again to resume (finished runs are kept).
Prints the table beside the paper's rows and writes scaling.md and scaling.png to --out.
"""

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

from mlx_diloco.blas import ensure_fast_blas

if __name__ == "__main__":
    ensure_fast_blas([__file__, *sys.argv[1:]])  # Linux: re-run with OpenBLAS preloaded

MODEL, SEQ = "tiny", 32            # tiny: 42,144 parameters, vocab 512, context 32
TOKENS_PER_PARAMETER = 20
GLOBAL_BATCH = 16                  # sequences of 32 tokens: 512 tokens per step, every M
EVAL_SEQUENCES = 512               # the same first 512 held-out sequences for every run
LR = 4e-3                          # the inner lr of the outer-lr sweep
DP_LRS = (1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2)
OUTER_LRS = (0.2, 0.4, 0.6, 0.8, 1.0)  # the paper's grid
REPLICAS = (1, 2, 4, 8)
H, H_LONG = 30, 50
GRID = {1: OUTER_LRS[:4], 2: OUTER_LRS[:4], 4: OUTER_LRS[1:], 8: OUTER_LRS[1:]}  # outer lrs run at H = 30
# The paper's Table 4, percent above DP at M = 1, 2, 4, 8 (research39 / the paper's section 4).
PAPER = {"35M": (-0.1, 0.7, 2.0, 3.9), "90M": (-0.1, 0.5, 1.5, 3.1), "180M": (-0.2, 0.3, 1.1, 2.3)}
PAPER_BEST_OUTER_LR_35M = (0.6, 0.6, 0.6, 1.0)  # Figure 7, H = 30


def recipe(parameters: int) -> dict:
    """The config shared by every run: the token budget as steps of the global batch, and the
    paper's inner settings."""
    steps = TOKENS_PER_PARAMETER * parameters // (GLOBAL_BATCH * SEQ)
    return dict(model=MODEL, seq_len=SEQ, steps=steps, warmup=steps // 10, final_lr=0.05, beta1=0.9,
                beta2=0.99, weight_decay=1 / steps, grad_clip=1.0, eval_every=5 * H, data="shakespeare")


def run_config(base: dict, M: int, lr: float, outer_lr: float = None, sync_every: int = H) -> dict:
    """DP (M = 0: one worker on the whole batch) or DiLoCo with M replicas of B/M each."""
    workers = max(M, 1)
    run = {**base, "workers": workers, "batch_size": GLOBAL_BATCH // workers, "lr": lr,
           "eval_batches": EVAL_SEQUENCES // (GLOBAL_BATCH // workers)}
    if M == 0:
        return {**run, "strategy": "ddp"}
    return {**run, "strategy": "diloco", "sync_every": sync_every, "outer_lr": outer_lr, "outer_momentum": 0.9}


def name(run: dict) -> str:
    if run["strategy"] == "ddp":
        return f"dp_lr{run['lr']:g}"
    return f"M{run['workers']}_H{run['sync_every']}_olr{run['outer_lr']:g}_lr{run['lr']:g}"


def train(run: dict, run_dir: str) -> dict:
    """One run in this process (a pool's worker), resumed if it was cut off: its summary and config."""
    from mlx_diloco.config import TrainConfig
    from mlx_diloco.run_folder import latest_step
    from mlx_diloco.training.processes import simulate
    summary = Path(run_dir) / "summary.json"
    if not summary.exists():
        simulate(TrainConfig.from_dict(run), Path(run_dir), processes=1,
                 resume=latest_step(run_dir) is not None, log=lambda m: None)
    return {**json.loads(summary.read_text()), **json.loads((Path(run_dir) / "config.json").read_text())}


def run_all(runs: list, out: Path, parallel: int) -> dict:
    """{name: summary} of every run, `parallel` at a time."""
    with ProcessPoolExecutor(parallel, mp_context=get_context("spawn")) as pool:
        futures = {name(r): pool.submit(train, r, str(out / name(r))) for r in runs}
        done = {}
        for key, future in futures.items():
            done[key] = future.result()
            print(f"  {key}: eval {done[key]['final_eval_loss']:.4f}", flush=True)
        return done


def loss(results: dict, key: str) -> float:
    return results[key]["final_eval_loss"]


def best(results: dict, prefix: str) -> str:
    """The run of `results` whose name starts with `prefix` that ended with the lowest eval loss."""
    return min((k for k in results if k.startswith(prefix)), key=lambda k: loss(results, k))


def table(results: dict, parameters: int, steps: int, epochs: float) -> str:
    dp = best(results, "dp_")
    rows = [f"{MODEL} ({parameters:,} parameters), {TOKENS_PER_PARAMETER} tokens per parameter "
            f"({TOKENS_PER_PARAMETER * parameters / 1e6:.2f}M tokens, {epochs:.2f} epochs of the train split), "
            f"global batch {GLOBAL_BATCH} x {SEQ} tokens, {steps:,} steps, H = {H} ({-(-steps // H)} outer steps)",
            "", "| | DP | M = 1 | M = 2 | M = 4 | M = 8 |", "|---|---|---|---|---|---|"]
    cells, lrs, inner = [], [], []
    for M in REPLICAS:
        k = best(results, f"M{M}_H{H}_")
        cells.append(f"{loss(results, k):.4f} ({loss(results, k) / loss(results, dp) - 1:+.1%})")
        lrs.append(f"{results[k]['outer_lr']:g}")
        inner.append(f"{results[k]['lr']:g}")
    rows.append(f"| {MODEL}, this run | {loss(results, dp):.4f} | " + " | ".join(cells) + " |")
    rows.append("| best outer lr (H = 30) | | " + " | ".join(lrs) + " |")
    rows.append(f"| best inner lr | {results[dp]['lr']:g} (of {len(DP_LRS)}) | " + " | ".join(inner) + " |")
    for size, gaps in PAPER.items():
        rows.append(f"| paper, {size} | | " + " | ".join(f"{g:+.1f}%" for g in gaps) + " |")
    rows.append("| paper, best outer lr at 35M | | " + " | ".join(f"{x:g}" for x in PAPER_BEST_OUTER_LR_35M) + " |")
    dp_by_lr = ", ".join(f"{lr:g}: {loss(results, f'dp_lr{lr:g}'):.4f}" for lr in DP_LRS)
    rows += ["", f"Eval loss by outer lr (inner lr {LR:g}; DP by inner lr: {dp_by_lr}):",
             "", "| M, H | " + " | ".join(f"{x:g}" for x in OUTER_LRS) + " |", "|---" * (len(OUTER_LRS) + 1) + "|"]
    for M, h in [*((M, H) for M in REPLICAS), (4, H_LONG)]:
        rows.append(f"| {M}, {h} | " + " | ".join(f"{loss(results, key):.4f}" if (key := f"M{M}_H{h}_olr{x:g}_lr{LR:g}")
                                                   in results else "-" for x in OUTER_LRS) + " |")
    return "\n".join(rows)


def plot(results: dict, out: Path) -> Path:
    """Left: eval loss against the outer lr, a line per (M, H), DP's best as a level. Right: eval
    (solid) and train (dotted) loss against steps for DP's best and each M's best."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from mlx_diloco.tools.plot import save_figure
    from mlx_diloco.training.metrics import MetricsLog

    dp = best(results, "dp_")
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for M, h in [*((M, H) for M in REPLICAS), (4, H_LONG)]:
        ran = [(x, loss(results, key)) for x in OUTER_LRS if (key := f"M{M}_H{h}_olr{x:g}_lr{LR:g}") in results]
        left.plot(*zip(*ran), marker="o", linestyle="-" if h == H else "--", label=f"M={M}, H={h}")
    left.axhline(loss(results, dp), color="black", linewidth=1, label=f"DP (lr {results[dp]['lr']:g})")
    left.set_xlabel("outer lr")
    left.set_ylabel("final eval loss")
    left.set_title(f"inner lr {LR:g}")
    left.grid(alpha=0.3)
    left.legend(fontsize=7)
    for key in [dp, *(best(results, f"M{M}_H{H}_") for M in REPLICAS)]:
        rows = MetricsLog.read(out / key)[1:]
        line, = right.plot([r["step"] for r in rows], [r["eval_loss"] for r in rows], marker=".", label=key)
        train = [r for r in rows if r.get("train_loss") is not None]
        right.plot([r["step"] for r in train], [r["train_loss"] for r in train], linestyle=":", color=line.get_color())
    right.set_xlabel("step")
    right.set_ylabel("loss (solid: held-out eval; dotted: train)")
    right.set_title("DP and each M at its best")
    right.grid(alpha=0.3)
    right.legend(fontsize=7)
    return save_figure(fig, out / "scaling.png", "DiLoCo against DP at 20 tokens per parameter (tiny)")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/bench/scaling")
    p.add_argument("--parallel", type=int, default=2, help="runs at a time, one process each")
    args = p.parse_args()
    out = Path(args.out)
    from mlx_diloco.data.datasets import prepare
    from mlx_diloco.models.zoo import build_model, count_parameters, load_spec
    spec = load_spec(MODEL)
    parameters = count_parameters(build_model(spec))
    train_tokens = len(prepare("shakespeare", SEQ, spec.vocab_size, "", log=lambda m: None).train) * SEQ
    base = recipe(parameters)
    start = time.time()
    print(f"# python bench/scaling_table.py: {MODEL}, {parameters:,} parameters, {base['steps']:,} steps", flush=True)
    runs = [run_config(base, 0, lr) for lr in DP_LRS] + [run_config(base, M, LR, x) for M in REPLICAS for x in GRID[M]]
    results = run_all(runs, out, args.parallel)
    best_outer = {M: results[best(results, f"M{M}_H{H}_")]["outer_lr"] for M in REPLICAS}
    more = [run_config(base, 4, LR, x, H_LONG) for x in OUTER_LRS if abs(x - best_outer[4]) < 0.3]  # around M=4's best
    more += [run_config(base, M, 2 * LR, best_outer[M]) for M in REPLICAS]
    results.update(run_all(more, out, args.parallel))
    text = table(results, parameters, base["steps"], TOKENS_PER_PARAMETER * parameters / train_tokens)
    print(text)
    print(f"\n{len(results)} runs, {args.parallel} at a time: {time.time() - start:.0f} s this invocation")
    (out / "scaling.md").write_text(text + "\n")
    print(f"plot: {plot(results, out)}")


if __name__ == "__main__":
    main()
