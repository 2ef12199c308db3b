"""GRPO and DPO over DiLoCo on the addition task (issue 38): DiLoCo x4 against DDP x4 and one worker,
at equal prompts seen, from the same SFT start and seed.

    python bench/post_training.py [--out runs/post-training] [--only grpo dpo]

The gym's problems addition-grpo and addition-dpo (mlx_diloco/gym/problems.py; their SFT start, a
tiny Llama taught 2-3 digit addition, is made on first use: gym/addition.py). GRPO: DiLoCo x4 (the
problem's H), DDP x4, and one worker taking four times the steps (the same prompts seen); DPO: DiLoCo
x4, DDP x4 and one worker. Prints each problem's scorecards (held-out accuracy at the start and the end, bytes
sent), DiLoCo's accuracy against DDP's and the bytes each sent, and writes PROBLEM.png (accuracy
against modelled time and bytes) and PROBLEM-metrics.png (every metric against steps) into --out.
Finished runs are kept when run again. About 25 minutes on a 2-core CPU shared with other work.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_diloco.blas import ensure_fast_blas  # noqa: E402

if __name__ == "__main__":
    ensure_fast_blas(sys.argv)

# DDP exchanges fp16 gradients every step, as data-parallel training does (the problem's compress is DiLoCo's).
DDP = {"strategy": "ddp", "compress": "fp16"}
SETUPS = {
    "grpo": {"diloco x4": {}, "ddp x4": DDP, "one worker": {**DDP, "workers": 1}},
    "dpo": {"diloco x4": {}, "ddp x4": DDP, "one worker": {**DDP, "workers": 1}},
}
ACCURACY = {"grpo": "eval_accuracy", "dpo": "eval_pair_accuracy"}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/post-training", help="folder for the runs and plots")
    p.add_argument("--only", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    args = p.parse_args()

    from mlx_diloco.config import TrainConfig
    from mlx_diloco.gym import scorecard
    from mlx_diloco.gym.problems import get_problem
    from mlx_diloco.tools.plot import plot_runs
    from mlx_diloco.run_folder import latest_step
    from mlx_diloco.training.processes import simulate

    for objective in args.only:
        problem = get_problem(f"addition-{objective}")
        cards = {}
        for label, setup in SETUPS[objective].items():
            run_dir = Path(args.out) / objective / label.replace(" ", "-")
            settings = problem.prepared(log=lambda m: print(m, flush=True), strategy=setup.get("strategy", "diloco"))
            config = {**settings, **setup}
            if config.get("workers") == 1:  # the prompts the four workers see, one after another
                config["steps"] *= settings["workers"]
                config["eval_every"] *= settings["workers"]
            if not (run_dir / "summary.json").exists():
                simulate(TrainConfig.from_dict(config), run_dir, log=lambda m: None,
                         resume=latest_step(run_dir) is not None)
            cards[label] = card = scorecard.scorecard(run_dir, problem)
            card["label"] = label
            scorecard.save(card, run_dir)
            print(f"{problem.name} {label}: {scorecard.post_training(card)}; sent per worker "
                  f"{scorecard.fmt(card['bytes_sent_per_worker'], 'bytes')}; {card['wall_s']:.0f} s", flush=True)
            if objective == "dpo":  # likelihood displacement: the chosen answers' log-probability, start and end
                rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
                print(f"  held-out chosen answers' mean log-probability: {rows[0]['eval_logps_chosen']:.3f} at the "
                      f"start, {rows[-1]['eval_logps_chosen']:.3f} at the end", flush=True)
        key = ACCURACY[objective]
        diloco, ddp = cards["diloco x4"], cards["ddp x4"]
        print(f"\n{problem.name}: {problem.about}\n{scorecard.table(list(cards.values()))}\n")
        print(f"start (SFT model): {100 * diloco[key + '_start']:.1f}%; DiLoCo x4 {100 * diloco[key]:.1f}% vs DDP x4 "
              f"{100 * ddp[key]:.1f}% ({100 * (diloco[key] - ddp[key]):+.1f} points); DDP sent "
              f"{ddp['bytes_sent_per_worker'] / diloco['bytes_sent_per_worker']:.1f}x DiLoCo's bytes per worker\n")
        scorecard.plot(list(cards.values()), Path(args.out) / f"{problem.name}.png", title=problem.about)
        plot_runs([c["run_dir"] for c in cards.values()], Path(args.out) / f"{problem.name}-metrics.png",
                  title=problem.about)


if __name__ == "__main__":
    main()
