"""The rule `--outer-lr auto --outer-momentum auto` reads, fitted to bench/outer_grid.py's runs, and
how much it loses against each cell's best, on the cells it was fitted to and on those left out.

    .venv/bin/python bench/outer_fit.py [--grid runs/bench/outer-grid/outer-grid.json ...]

A cell is (M, H, T); its best is the lowest eval loss over the momenta and outer lrs the walk tried,
against DP's best at the same T. The rule's table has, for each measured M and each outer-steps
bucket N (cells whose T/H rounds to it in log), the momentum whose best is lowest on average over
the bucket's cells and the geometric mean of those cells' best momentum-adjusted lr eta = lr/(1-mu).
Prints the table as strategies/outer_lr.py writes it, then each cell: its best, the rule's choice and
the rule's regret (the run at the rule's eta and mu if the walk measured it, else the nearest eta
measured at that mu).
"""

import argparse
import json
import math
import re
from collections import defaultdict

NAME = re.compile(r"M(\d+)_H(\d+)_T(\d+)_mu([\d.]+)_olr([\d.]+)_lr([\d.e-]+)$")
DP = re.compile(r"dp_T(\d+)_lr([\d.e-]+)$")
BUCKETS = (11, 17, 55, 110, 165, 330)
FIT_M = (1, 4, 8)


def read(paths: list) -> tuple:
    """({(M, H, T): {(mu, eta): loss}}, {T: DP's best loss}) of every run in the grid files."""
    cells, dp = defaultdict(dict), {}
    for path in paths:
        for name, loss in json.loads(open(path).read()).items():
            if m := NAME.match(name):
                M, H, T, mu, lr = int(m[1]), int(m[2]), int(m[3]), float(m[4]), float(m[5])
                cells[(M, H, T)][(mu, round(lr / (1 - mu), 2))] = loss
            elif d := DP.match(name):
                dp[int(d[1])] = min(dp.get(int(d[1]), math.inf), loss)
    return cells, dp


def bucket(N: float) -> int:
    return min(BUCKETS, key=lambda b: abs(math.log(b / N)))


def best_per_mu(runs: dict) -> dict:
    """{mu: (eta, loss)} of a cell's lowest loss at each momentum."""
    out = {}
    for (mu, eta), loss in runs.items():
        if mu not in out or loss < out[mu][1]:
            out[mu] = (eta, loss)
    return out


def fit(cells: dict, dp: dict) -> dict:
    """{M: {N: (eta, mu, mean gap %)}} over the fitted M."""
    table = {}
    for M in FIT_M:
        by_bucket = defaultdict(list)
        for (m, H, T), runs in cells.items():
            if m == M:
                by_bucket[bucket(T / H)].append((best_per_mu(runs), dp[T]))
        table[M] = {}
        for N, group in sorted(by_bucket.items()):
            momenta = set.intersection(*(set(b) for b, _ in group))
            gaps = {mu: sum(b[mu][1] / d - 1 for b, d in group) / len(group) for mu in momenta}
            mu = min(gaps, key=gaps.get)
            eta = math.exp(sum(math.log(b[mu][0]) for b, _ in group) / len(group))
            table[M][N] = (round(eta, 2), mu, round(100 * gaps[mu], 2))
    return table


def rule(table: dict, M: int, N: float) -> tuple:
    """(eta, mu) of the table for a run of M workers and N outer steps, as outer_lr.choose reads it."""
    m = min((k for k in table if k >= M), default=max(table))
    row = table[m]
    n = min(row, key=lambda b: abs(math.log(b / N)))
    return row[n][:2]


def regret(runs: dict, eta: float, mu: float) -> tuple:
    """(loss at the rule's choice or the nearest eta measured at mu, the eta taken) (None if mu unmeasured)."""
    at_mu = {e: loss for (m, e), loss in runs.items() if m == mu}
    if not at_mu:
        return None, None
    e = min(at_mu, key=lambda x: abs(math.log(x / eta)))
    return at_mu[e], e


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grid", nargs="+", default=["runs/bench/outer-grid/outer-grid.json"])
    args = p.parse_args()
    cells, dp = read(args.grid)
    table = fit(cells, dp)
    print("# the rule (eta, mu, mean gap % vs DP) by M and outer steps N:")
    for M, row in table.items():
        print(f"M={M}: " + ", ".join(f"N~{N}: eta {e:g} mu {mu:g} ({g:+.2f}%)" for N, (e, mu, g) in row.items()))
    print("\n| M | H | T | N | best (eta, mu) | best vs DP | rule (eta, mu) | rule vs DP | regret | fitted |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (M, H, T), runs in sorted(cells.items()):
        (mu_b, eta_b), best = min(runs.items(), key=lambda kv: kv[1])
        eta_r, mu_r = rule(table, M, T / H)
        loss, e = regret(runs, eta_r, mu_r)
        shown = f"{loss / dp[T] - 1:+.2%}" if loss else "-"
        print(f"| {M} | {H} | {T} | {T / H:.0f} | {eta_b:g}, {mu_b:g} | {best / dp[T] - 1:+.2%} | {eta_r:g}, {mu_r:g}"
              f"{'' if e is None or abs(e - eta_r) < 0.01 else f' (measured {e:g})'} | {shown} | "
              f"{(loss / best - 1) if loss else float('nan'):+.2%} | {'yes' if M in FIT_M else 'no'} |")


if __name__ == "__main__":
    main()
