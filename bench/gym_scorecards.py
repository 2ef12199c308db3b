"""Scorecards of every strategy of the zoo on gym problems, side by side, each at its published
defaults.

    python bench/gym_scorecards.py [--problems shakespeare-home gpt-wifi-8 mixed-home] [--out runs/gym-cards]

For each problem: every strategy of STRATEGIES (DDP, DiLoCo, FedAvg, Streaming DiLoCo with a 4-bit
exchange, SPARTA, DeMo, MuLoCo, SPARTA-DiLoCo, SparseLoCo, DES-LOC, Local Adam, quorum rounds,
NoLoCo); on a problem whose workers differ in speed, DiLoCo also time-paced and quorum rounds
time-paced (workers step at their own speed). One `gym run` each (finished runs are kept when run
again). Prints one Markdown table per problem and writes PROBLEM.png (the curves) into --out. The
CPU variants take 1 to 5 minutes per run on a 2-core CPU.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_diloco.blas import ensure_fast_blas  # noqa: E402

if __name__ == "__main__":
    ensure_fast_blas(sys.argv)

from cluster_links import doctor_gflops  # noqa: E402

# The new strategies and their baselines first, so that a run cut short still compares them.
STRATEGIES = {
    "ddp": dict(strategy="ddp"),
    "diloco": dict(strategy="diloco"),
    "sparseloco": dict(strategy="sparseloco"),
    "desloc": dict(strategy="desloc"),
    "local-adam": dict(strategy="desloc", first_moment_sync_every=50, second_moment_sync_every=50),  # Ku = Kv = Kx
    "noloco": dict(strategy="noloco"),
    "fedavg": dict(strategy="fedavg"),
    "streaming-int4": dict(strategy="diloco", fragments=5, overlap_steps=1, compress="int4"),
    "sparta": dict(strategy="sparta"),
    "demo": dict(strategy="demo"),
    "muloco": dict(strategy="muloco"),
    "sparta-diloco": dict(strategy="sparta-diloco"),
}
# Quorum rounds differ from DiLoCo only when workers step at their own pace (with equal speeds, or
# the fixed policy, every worker reports at once and it is DiLoCo: tests/test_quorum.py): on a
# problem whose workers differ in speed, DiLoCo and quorum rounds time-paced.
PACED = {
    "diloco-time": dict(strategy="diloco", speed_policy="time"),
    "quorum-time": dict(strategy="quorum", speed_policy="time"),
}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--problems", nargs="+", default=["shakespeare-home", "gpt-wifi-8", "mixed-home"])
    p.add_argument("--strategies", nargs="+", default=list(STRATEGIES) + list(PACED),
                   choices=list(STRATEGIES) + list(PACED))
    p.add_argument("--out", default="runs/gym-cards", help="folder for the runs and plots")
    args = p.parse_args()
    print(f"# python bench/gym_scorecards.py --problems {' '.join(args.problems)}   (doctor: {doctor_gflops()})", flush=True)

    from mlx_diloco.config import TrainConfig
    from mlx_diloco.gym import scorecard
    from mlx_diloco.gym.problems import get_problem
    from mlx_diloco.models.zoo import load_spec
    from mlx_diloco.run_folder import latest_step
    from mlx_diloco.training.processes import simulate

    problems = {name: get_problem(name) for name in args.problems}
    cards = {name: [] for name in problems}
    for label in args.strategies:  # each strategy on every problem, then the next
        for name, problem in problems.items():
            settings = problem.settings()
            if label in PACED and not settings.get("worker_speeds"):
                continue
            options = dict({**STRATEGIES, **PACED}[label])
            if "fragments" in options:
                options["fragments"] = min(options["fragments"], max(load_spec(settings["model"]).num_blocks, 1))
            run_dir = Path(args.out) / name / label
            if not (run_dir / "summary.json").exists():
                simulate(TrainConfig.from_dict({**settings, **options}), run_dir, log=lambda m: None,
                         resume=latest_step(run_dir) is not None)
            card = scorecard.scorecard(run_dir, problem)
            card["label"] = label
            scorecard.save(card, run_dir)
            cards[name].append(card)
            print(f"{name} {label}: eval loss {card['final_eval_loss']:.4f}, {card['wall_s']:.0f} s", flush=True)
    for name, problem in problems.items():
        print(f"\n{name}: {problem.about}; target eval loss {problem.target_loss}\n{scorecard.table(cards[name])}\n")
        scorecard.plot(cards[name], Path(args.out) / f"{name}.png", title=f"{name}: {problem.about}")
    print(f"summary: {summary_plot(cards, Path(args.out) / 'summary.png')}")


def summary_plot(cards: dict, out: Path) -> Path:
    """Every run's final eval loss against the bytes each worker sent (top) and the modelled time
    (bottom), a column per problem: the strategies' trade-off at a glance, a labelled point each."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from mlx_diloco.tools.plot import save_figure

    cards = {name: runs for name, runs in cards.items() if runs}  # (a paced strategy alone skips equal speeds)
    fig, axes = plt.subplots(2, len(cards), figsize=(5.5 * len(cards), 8), squeeze=False)
    for column, (name, runs) in enumerate(cards.items()):
        for row, (key, what) in enumerate([("bytes_sent_per_worker", "bytes sent per worker"),
                                           ("modelled_s", f"modelled time (s) on {runs[0]['link']}")]):
            ax = axes[row][column]
            for card in runs:
                ax.scatter(card[key], card["final_eval_loss"], s=18)
                ax.annotate(card["label"], (card[key], card["final_eval_loss"]), fontsize=7,
                            xytext=(3, 3), textcoords="offset points")
            ax.set_xscale("log")
            if key == "modelled_s":  # seconds as numbers at 1, 2, 5 x 10^k, not powers of ten
                ax.xaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1, 2, 5)))
                ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
                ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.set_xlabel(what + ", log scale")
            ax.set_ylabel("final eval loss (global model)")
            ax.grid(alpha=0.3)
        axes[0][column].set_title(name)
    return save_figure(fig, out, "every strategy at its published defaults: lower left is better")


if __name__ == "__main__":
    main()
