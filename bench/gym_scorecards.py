"""Scorecards of the zoo's strategies on gym problems, side by side.

    python bench/gym_scorecards.py [--problems shakespeare-home fashion-thunderbolt] [--out runs/gym-cards]

For each problem: DDP, DiLoCo, Streaming DiLoCo (4-bit exchange, fragments where the model has
blocks, one step of overlap), SPARTA, DeMo and MuLoCo (DiLoCo with Muon inner steps), each with
its default options; one `gym run` each (finished runs are kept when run again). Prints one
Markdown table per problem and writes PROBLEM.png (the curves) into --out. The CPU variants take
about 5 minutes per run of shakespeare-home and 1 of fashion-thunderbolt on a 2-core CPU.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_diloco.blas import ensure_fast_blas  # noqa: E402

if __name__ == "__main__":
    ensure_fast_blas(sys.argv)

STRATEGIES = {
    "ddp": dict(strategy="ddp"),
    "diloco": dict(strategy="diloco"),
    "streaming-int4": dict(strategy="diloco", fragments=5, overlap_steps=1, compress="int4"),
    "sparta": dict(strategy="sparta"),
    "demo": dict(strategy="demo"),
    "muloco": dict(strategy="muloco"),
}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--problems", nargs="+", default=["shakespeare-home", "fashion-thunderbolt"])
    p.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    p.add_argument("--out", default="runs/gym-cards", help="folder for the runs and plots")
    args = p.parse_args()

    from mlx_diloco.config import TrainConfig
    from mlx_diloco.gym import scorecard
    from mlx_diloco.gym.problems import get_problem
    from mlx_diloco.models.zoo import load_spec
    from mlx_diloco.training.processes import simulate

    for name in args.problems:
        problem = get_problem(name)
        settings = problem.settings()
        blocks = load_spec(settings["model"]).num_blocks
        cards = []
        for label in args.strategies:
            options = dict(STRATEGIES[label])
            if "fragments" in options:
                options["fragments"] = min(options["fragments"], max(blocks, 1))
            run_dir = Path(args.out) / name / label
            if not (run_dir / "summary.json").exists():
                simulate(TrainConfig.from_dict({**settings, **options}), run_dir, log=lambda m: None)
            card = scorecard.scorecard(run_dir, problem)
            card["label"] = label
            scorecard.save(card, run_dir)
            cards.append(card)
            print(f"{name} {label}: eval loss {card['final_eval_loss']:.4f}, {card['wall_s']:.0f} s", flush=True)
        print(f"\n{name}: {problem.about}; target eval loss {problem.target_loss}\n{scorecard.table(cards)}\n")
        scorecard.plot(cards, Path(args.out) / f"{name}.png", title=f"{name}: {problem.about}")


if __name__ == "__main__":
    main()
