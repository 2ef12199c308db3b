"""A run's scorecard: what a gym problem asks of a strategy, read from the run folder.

    final eval loss       the global model at the end
    to target             inner steps, tokens (examples, for data that is not tokens) and
                          modelled seconds until the eval loss first reaches the problem's
                          target (None: not reached)
    bytes sent            per worker, in all; and the largest single exchange
    utilisation           modelled share of the time spent computing (not waiting for the link
                          or for slower workers) on the problem's link
    measured              the same share as this machine measured it (its waits on its peers,
                          split into the link and slower workers: comm.py), and the model FLOPs
                          utilisation, MFU (utilisation.py)
    drift                 how far the workers' models are apart when they sync: the spread
                          (max - min) of their eval losses, mean over the evaluations
    post-training         (objectives/) the held-out accuracy at the start and the end: GRPO's
                          greedy exact answers, DPO's and ORPO's pairs whose chosen completion is the
                          more likely; GRPO's tokens generated and seconds generating and training
"""

import json
import math
from pathlib import Path

from ..config import ConfigError, read_json
from ..tools.plot import amount_axis, label, loss_curves, save_figure
from ..objectives.kinds import DEFAULT, kind
from ..records import CARD, ROW, SUMMARY, TIME_NAMES
from ..training.metrics import MetricsLog, human_bytes

FILE = "scorecard.json"
# Post-training's held-out accuracies (the first a run has is what its plot shows), at the start and
# the end; and what it generated.
ACCURACIES = {ROW.eval_accuracy: CARD.eval_accuracy_start, ROW.eval_pair_accuracy: CARD.eval_pair_accuracy_start,
              ROW.eval_reward_accuracy: CARD.eval_reward_accuracy_start}  # at the end: at the start
TOTALS = (ROW.tokens_generated, ROW.tokens_trained, ROW.generate_s, ROW.train_s)


def spread(losses: list):
    """How far the workers' local models are apart: the largest loss minus the smallest, over the
    workers that are members (a non-member's is NaN); None with fewer than two."""
    members = [x for x in losses if x is not None and math.isfinite(x)]
    return max(members) - min(members) if len(members) > 1 else None


def scorecard(run_dir, problem=None, target_loss: float = None) -> dict:
    """The scorecard of a finished run (`problem`: the gym problem it ran, or None)."""
    run_dir = Path(run_dir)
    rows = MetricsLog.read(run_dir)
    config = json.loads((run_dir / "config.json").read_text())
    target = target_loss if target_loss is not None else (problem.target_loss if problem else None)
    last = rows[-1]
    reached = next((r for r in rows if target is not None and r[ROW.eval_loss] <= target), None)
    spreads = [s for r in rows[1:] if (s := spread(r.get(ROW.eval_loss_workers) or [])) is not None]
    options = last.get(ROW.strategy_options) or {}
    return CARD.check({
        CARD.problem: problem.name if problem else None, CARD.run_dir: str(run_dir),
        CARD.strategy: last[ROW.strategy], CARD.label: label(last[ROW.strategy], options, config),
        CARD.workers: last[ROW.workers], CARD.steps: last[ROW.step], CARD.tokens: last[ROW.tokens],
        CARD.examples: last.get(ROW.examples), CARD.examples_to_target: reached and reached.get(ROW.examples),
        CARD.final_eval_loss: last[ROW.eval_loss], CARD.target_loss: target,
        CARD.steps_to_target: reached and reached[ROW.step], CARD.tokens_to_target: reached and reached[ROW.tokens],
        CARD.modelled_s_to_target: reached and reached[ROW.modelled_time_s],
        CARD.modelled_s: last[ROW.modelled_time_s], CARD.link: last[ROW.link],
        CARD.bytes_sent_per_worker: last[ROW.bytes_sent_per_worker], CARD.peak_exchange_bytes: last[ROW.peak_exchange_bytes],
        CARD.utilisation: last[ROW.utilisation], CARD.idle_fraction: last.get(ROW.idle_fraction, 0.0),
        **{key: last.get(key) for key in (ROW.measured_utilisation, ROW.busy_s, ROW.link_s, ROW.straggler_s, ROW.mfu)},
        CARD.worker_spread: sum(spreads) / len(spreads) if spreads else 0.0,
        CARD.wall_s: last[ROW.wall_s], CARD.strategy_options: options,
        CARD.worker_speeds: config.get("worker_speeds", ""), CARD.speed_policy: config.get("speed_policy", "fixed"),
        CARD.objective: config.get("objective", DEFAULT),
        **{k: v for key, start in ACCURACIES.items() if key in last for k, v in ((start, rows[0].get(key)), (key, last[key]))},
        **{key: last[key] for key in TOTALS if key in last},
    })


def save(card: dict, run_dir) -> Path:
    path = Path(run_dir) / FILE
    path.write_text(json.dumps(card, indent=1))
    return path


def load(path) -> dict:
    """A scorecard from its file or its run folder (made from the run if it has none yet)."""
    path = Path(path)
    if path.is_dir():
        return json.loads((path / FILE).read_text()) if (path / FILE).exists() else scorecard(path)
    if not path.exists():
        raise ConfigError(f"{path} does not exist; pass scorecard.json files or run folders")
    card = read_json(path, "a scorecard", "pass scorecard.json files or run folders")
    if not isinstance(card, dict) or CARD.final_eval_loss not in card:
        raise ConfigError(f"{path} is not a scorecard (no final_eval_loss); pass scorecard.json files or run folders")
    return card


def fmt(value, kind: str = "") -> str:
    if value is None:
        return "-"
    if kind == "bytes":
        return human_bytes(value)
    if kind == "s":
        return f"{value:,.0f} s" if value >= 10 else f"{value:.1f} s"
    if kind == "%":
        return f"{100 * value:.0f}%" if value >= 0.1 else f"{100 * value:.1f}%"
    if kind == "points":  # an accuracy, to a tenth of a point
        return f"{100 * value:.1f}%"
    if isinstance(value, float):
        return f"{value:.4f}" if kind == "loss" else f"{value:.3g}"
    return f"{value:,}" if isinstance(value, int) else str(value)


COLUMNS = [("run", CARD.label, ""), ("workers", CARD.workers, ""), ("eval loss", CARD.final_eval_loss, "loss"),
           ("steps to target", CARD.steps_to_target, ""), ("time to target", CARD.modelled_s_to_target, "s"),
           ("time", CARD.modelled_s, "s"), ("sent/worker", CARD.bytes_sent_per_worker, "bytes"),
           ("peak exchange", CARD.peak_exchange_bytes, "bytes"), ("utilisation", CARD.utilisation, "%"),
           ("measured", CARD.measured_utilisation, "%"), ("MFU", CARD.mfu, "%"),
           ("worker spread", CARD.worker_spread, "")]


# Shown where a scorecard has them (post-training's).
OBJECTIVE_COLUMNS = [("accuracy at start", CARD.eval_accuracy_start, "points"), ("accuracy", CARD.eval_accuracy, "points"),
                     ("pairs at start", CARD.eval_pair_accuracy_start, "points"),
                     ("pairs", CARD.eval_pair_accuracy, "points"),
                     ("DPO reward accuracy", CARD.eval_reward_accuracy, "points"),
                     ("generating", CARD.generate_s, "s"), ("training", CARD.train_s, "s")]


def table(cards: list) -> str:
    """A Markdown table of scorecards, one row each."""
    columns = COLUMNS + [c for c in OBJECTIVE_COLUMNS if any(card.get(c[1]) is not None for card in cards)]
    head = "| " + " | ".join(name for name, _, _ in columns) + " |"
    rule = "|" + "|".join("---" for _ in columns) + "|"
    rows = ["| " + " | ".join(fmt(c.get(key), kind) for _, key, kind in columns) + " |" for c in cards]
    return "\n".join([head, rule] + rows)


def describe(card: dict) -> str:
    """The scorecard in a few lines, for the terminal."""
    c = CARD
    target = card[c.target_loss]
    amount = (f"{fmt(card[c.tokens_to_target])} tokens" if card[c.tokens_to_target] is not None
              else f"{fmt(card.get(c.examples_to_target))} examples")
    reach = (f"reached {target} at step {card[c.steps_to_target]} ({amount}, "
             f"{fmt(card[c.modelled_s_to_target], 's')} modelled)" if card[c.steps_to_target]
             else f"did not reach {target}" if target is not None else "no target")
    idle = card[c.idle_fraction]
    return "\n".join([
        f"{card[c.problem] or 'run'}: {card[c.label]}, {card[c.workers]} workers -> {card[c.run_dir]}",
        f"  final eval loss {card[c.final_eval_loss]:.4f}; {reach}",
        f"  modelled time {fmt(card[c.modelled_s], 's')} on {card[c.link]}, utilisation {fmt(card[c.utilisation], '%')}"
        + (f", idle waiting for slower workers {fmt(idle, '%')}" if idle else ""),
        f"  measured here: {time_spent(card)}",
        f"  sent per worker {fmt(card[c.bytes_sent_per_worker], 'bytes')}, largest exchange "
        f"{fmt(card[c.peak_exchange_bytes], 'bytes')}; worker spread (eval loss max - min) {card[c.worker_spread]:.4f}",
    ] + [f"  {card[c.objective]}: {post_training(card)}"] * kind(card.get(c.objective, DEFAULT)).post_training)


ACCURACY_NAMES = {ROW.eval_accuracy: "held-out accuracy (greedy)", ROW.eval_pair_accuracy: "held-out pairs chosen over "
                  "rejected", ROW.eval_reward_accuracy: "DPO reward accuracy"}


def post_training(card: dict) -> str:
    """A post-training run's held-out accuracies, start to end, and its generation, in a line."""
    parts = [f"{ACCURACY_NAMES[key]} {fmt(card[start], 'points')} -> {fmt(card[key], 'points')}"
             for key, start in ACCURACIES.items() if card.get(key) is not None]
    return "; ".join(filter(None, parts + [generation(card)]))


def post_training_summary(s: dict) -> str:
    """A post-training run's summary in a line ('' for another run): its held-out accuracies at the end,
    the chosen answers' log-probability (DPO, ORPO) and its generation (GRPO)."""
    parts = [f"{ACCURACY_NAMES[key]} {fmt(s[key], 'points')}" for key in ACCURACIES if s.get(key) is not None]
    if s.get(ROW.eval_logps_chosen) is not None:
        parts.append(f"chosen answers' log-probability {s[ROW.eval_logps_chosen]:.3f}")
    return "; ".join(filter(None, parts + [generation(s)]))


def generation(s: dict) -> str:
    """What a GRPO run's generating cost, in a line (a scorecard, a summary; '' for a run that generates
    nothing): the completion tokens generated and trained, and the seconds generating against training
    per worker."""
    if s.get(ROW.tokens_generated) is None:
        return ""
    return (f"{fmt(s[ROW.tokens_generated])} tokens generated, {fmt(s.get(ROW.tokens_trained))} trained; per worker "
            f"{fmt(s.get(ROW.generate_s), 's')} generating, {fmt(s.get(ROW.train_s), 's')} training")


def time_split(s: dict) -> str:
    """Where a summary's wall-clock went (records.TIME), in a line: its parts' shares, largest first."""
    split, wall = s.get(SUMMARY.time_s), s.get(SUMMARY.process_s)
    if not split or not wall:  # a run from before the split was kept
        return "-"
    shares = sorted(((seconds / wall, TIME_NAMES[key]) for key, seconds in split.items() if seconds > wall / 2000),
                    reverse=True)  # (parts under 0.05%: left out)
    return (f"wall-clock {fmt(wall, 's')}: " + ", ".join(f"{name} {fmt(share, '%')}" for share, name in shares)
            + f" (the parts sum to {fmt(sum(split.values()) / wall, '%')} of it)")


def time_spent(s: dict) -> str:
    """Where a run's time went as measured, and its MFU, in a line (a scorecard, a summary)."""
    if s.get(SUMMARY.measured_utilisation) is None:  # a run from before these were measured
        return "-"
    restarts = s.get(SUMMARY.restart_s)
    return (f"compute {fmt(s[SUMMARY.busy_s], 's')}, waiting for the link {fmt(s[SUMMARY.link_s], 's')}, for slower "
            f"workers {fmt(s[SUMMARY.straggler_s], 's')}" + (f", restarts {fmt(restarts, 's')}" if restarts else "")
            + f"; utilisation {fmt(s[SUMMARY.measured_utilisation], '%')}, MFU {fmt(s[SUMMARY.mfu], '%')}")


def plot(cards: list, out: Path, title: str = None) -> Path:
    """Eval loss against modelled time and against bytes sent, one curve per scorecard's run."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    runs = [(c, MetricsLog.read(c[CARD.run_dir])) for c in cards]
    # post-training: its held-out accuracy, where every run has one; else the eval loss
    metric = next((k for k in ACCURACIES if all(k in r for _, rows in runs for r in rows)), ROW.eval_loss)
    links = sorted({c[CARD.link] for c in cards})
    keys = [(ROW.modelled_time_s, "modelled wall-clock (s)" + (f" on {links[0]}" if len(links) == 1 else "")),
            (ROW.bytes_sent_per_worker, "bytes sent per worker"), amount_axis(runs)]
    curves = [(c[CARD.label] + (f" on {c[CARD.link]}" if len(links) > 1 else ""), rows) for c, rows in runs]
    for ax, (key, name) in zip(axes, keys):
        loss_curves(ax, curves, key, name, metric)
        ax.set_ylabel("eval loss (global model)" if metric == ROW.eval_loss else f"{metric} (global model)")
    targets = {c[CARD.target_loss] for c in cards if c.get(CARD.target_loss) is not None}
    for ax in axes:
        for t in targets:
            ax.axhline(t, color="grey", linestyle=":", linewidth=1)
    axes[0].legend(fontsize=8)
    return save_figure(fig, out, title)
