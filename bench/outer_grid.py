"""The grid `--outer-lr auto` and `--outer-momentum auto` are fitted to (issue 44): DiLoCo's best
outer learning rate and momentum at `tiny` by the number of workers M, the sync period H and the
run's length T (so N = T/H outer steps), each against data-parallel (DP) at the same tokens.

    .venv/bin/python bench/outer_grid.py [--out runs/bench/outer-grid] [--stage landscape|fit|check|check2|size]
    nice -n 19 ...   (a loss sweep: it may run beside other work; no timing is taken from it)

The recipe is bench/scaling_table.py's (the scaling-law paper's, arXiv 2503.09799): global batch
16 x 32 tokens split over the M replicas, warmup T/10, cosine to 5%, weight decay 1/T, AdamW betas
0.9/0.99, clipping 1.0, the inner lr DP's best at that T. Every run evaluates the same first
EVAL_SEQUENCES held-out sequences (64K tokens).

For each (M, H, T) and each outer momentum mu, the outer lr is searched on a sqrt(2) grid of the
momentum-adjusted lr  eta = lr / (1 - mu)  (Khaled et al., arXiv 2509.10439: what an outer step
moves once the momentum is warm), walking from a start until the loss rises on both sides. Stages:
  landscape: four cells, every momentum of MOMENTA: the shape the rule takes;
  fit:       the cells the rule is fitted on (M 1/4/8; H 5 to 100; N ~11 to ~330);
  check:     cells left out of the fit (M = 2, other (H, T));
  check2:    cells left out of the rule's run-length term, which the check's M = 2, H = 10 cell showed
             (each side of it: 55 and 67 outer steps at H = 10 and 15, 165 and 329 at H = 10 and 5);
  size:      another model size, left out of the fit: `small` (1.1M parameters, 64-token sequences) at
             M = 4, H = 30 and 55 outer steps (1.5 tokens per parameter: a check of what the rule reads,
             M, H and N, at another size, not of 20 tokens per parameter, which would take days here).
Runs one at a time, one process each, resumed when run again (finished runs are kept).
Prints a table per stage and writes outer-grid.json (every run's loss) to --out.
"""

import argparse
import json
import sys

from mlx_diloco.blas import ensure_fast_blas

if __name__ == "__main__":
    ensure_fast_blas([__file__, *sys.argv[1:]])  # Linux: re-run with OpenBLAS preloaded

from tiny_recipe import MODEL, ROOT2, Runs, diloco_config, dp_config, steps_for, walk  # noqa: E402

T20 = steps_for(20, 16)               # 1,646: 20 tokens per parameter at a global batch of 16
DP_LRS = (1e-3, 1.4e-3, 2e-3, 2.8e-3, 4e-3, 5.7e-3, 8e-3, 1.13e-2, 1.6e-2, 2.26e-2)
MOMENTA = (0.0, 0.5, 0.8, 0.9)
LR_RANGE = (0.05, 2.0)                # outer lrs the walk may try

LANDSCAPE = [(4, 30, T20), (4, 10, T20), (4, 50, 550), (1, 30, T20)]
FIT = [(M, H, T) for M in (1, 4, 8) for H, T in
       [(5, 550), (5, T20), (10, 550), (10, T20), (30, 550), (30, T20), (30, 3 * T20), (50, 550),
        (100, T20), (100, 3 * T20)]]
CHECK = [(2, 30, T20), (2, 10, 550), (2, 100, T20), (4, 20, 1000), (8, 15, 3 * T20), (1, 20, 1000)]
CHECK2 = [(4, 10, 550), (4, 15, 1000), (2, 10, T20), (2, 5, T20)]
SIZE = [(4, 30, 1650, "small")]       # (M, H, T, model)
STAGES = {"landscape": LANDSCAPE, "fit": FIT, "check": CHECK, "check2": CHECK2, "size": SIZE}


def momenta(stage: str, N: float) -> tuple:
    """The landscape (M = 4: N = 11, 55, 165) found 0.9 worst by 2-5 points at every N; past it, the
    fit tries it only where N is long enough for its ~10-step memory to matter (N >= 150)."""
    return MOMENTA if stage == "landscape" or N >= 150 else MOMENTA[:3]


def best_dp(runs: Runs, T: int, seed: int = 0, model: str = MODEL) -> tuple:
    """(loss, lr) of DP's best inner lr at T, walking DP_LRS from 8e-3 until interior."""
    losses = {}
    walk(lambda j: losses.setdefault(j, runs.loss(dp_config(T, DP_LRS[j], seed=seed, model=model))),
         DP_LRS.index(8e-3), 0, len(DP_LRS) - 1)
    j = min(losses, key=losses.get)
    return losses[j], DP_LRS[j]


def search_outer(runs: Runs, M: int, H: int, T: int, lr: float, mu: float, eta0: float, seed: int = 0,
                 model: str = MODEL) -> dict:
    """{eta: loss} of the walk over eta = outer_lr / (1 - mu) on the sqrt(2) grid from eta0."""
    etas = {}

    def f(k: int) -> float:
        eta = eta0 * ROOT2 ** k
        outer = eta * (1 - mu)
        if not LR_RANGE[0] <= outer <= LR_RANGE[1]:
            return float("inf")
        return etas.setdefault(round(eta, 4), runs.loss(diloco_config(M, H, T, lr, outer, mu, seed=seed, model=model)))
    walk(f, 0, -12, 12)
    return etas


def start_eta(mu: float) -> float:
    """Where each momentum's walk starts: the identity step at mu = 0, the paper's 0.6/0.9 above it."""
    return {0.0: 1.0, 0.5: 2.0}.get(mu, 4.0)


def run_cells(runs: Runs, stage: str, cells: list, seed: int = 0) -> list:
    rows = []
    for M, H, T, *model in cells:
        model = model[0] if model else MODEL
        dp_loss, lr = best_dp(runs, T, model=model)
        for mu in momenta(stage, T / H):
            etas = search_outer(runs, M, H, T, lr, mu, start_eta(mu), seed, model)
            eta = min(etas, key=etas.get)
            rows.append(dict(M=M, H=H, T=T, N=T / H, model=model, mu=mu, eta=eta, outer_lr=round(eta * (1 - mu), 4),
                             loss=etas[eta], dp=dp_loss, gap=etas[eta] / dp_loss - 1, lr=lr, seed=seed,
                             curve={str(k): v for k, v in sorted(etas.items())}))
            print(f"{model} M={M} H={H} T={T} (N={T / H:.0f}) mu={mu}: best eta {eta:g} (lr {eta * (1 - mu):.3g}) "
                  f"{etas[eta]:.4f}, {etas[eta] / dp_loss - 1:+.2%} vs DP {dp_loss:.4f}", flush=True)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/bench/outer-grid")
    p.add_argument("--stage", choices=list(STAGES), nargs="+", default=["landscape"])
    p.add_argument("--workers", type=int, nargs="+", help="only the cells of these M (two sweeps side by side)")
    args = p.parse_args()
    runs = Runs(args.out, "outer-grid.json")
    for stage in args.stage:
        cells = [c for c in STAGES[stage] if not args.workers or c[0] in args.workers]
        print(f"# stage {stage}: {len(cells)} cells", flush=True)
        rows = run_cells(runs, stage, cells)
        (runs.out / f"{stage}.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
