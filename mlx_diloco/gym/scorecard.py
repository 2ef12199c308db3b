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
from ..plot import amount_axis, label, loss_curves, save_figure
from ..training.metrics import MetricsLog, human_bytes

CARD = "scorecard.json"
# Post-training's held-out accuracies (the first a run has is what its plot shows), at the start and
# the end; and what it generated.
ACCURACIES = ("eval_accuracy", "eval_pair_accuracy", "eval_reward_accuracy")
TOTALS = ("tokens_generated", "tokens_trained", "generate_s", "train_s")


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
    reached = next((r for r in rows if target is not None and r["eval_loss"] <= target), None)
    spreads = [s for r in rows[1:] if (s := spread(r.get("eval_loss_workers") or [])) is not None]
    options = last.get("strategy_options") or {}
    return {
        "problem": problem.name if problem else None, "run_dir": str(run_dir),
        "strategy": last["strategy"], "label": label(last["strategy"], options, config),
        "workers": last["workers"], "steps": last["step"], "tokens": last["tokens"],
        "examples": last.get("examples"), "examples_to_target": reached and reached.get("examples"),
        "final_eval_loss": last["eval_loss"], "target_loss": target,
        "steps_to_target": reached and reached["step"], "tokens_to_target": reached and reached["tokens"],
        "modelled_s_to_target": reached and reached["modelled_time_s"],
        "modelled_s": last["modelled_time_s"], "link": last["link"],
        "bytes_sent_per_worker": last["bytes_sent_per_worker"], "peak_exchange_bytes": last["peak_exchange_bytes"],
        "utilisation": last["utilisation"], "idle_fraction": last.get("idle_fraction", 0.0),
        **{key: last.get(key) for key in ("measured_utilisation", "busy_s", "link_s", "straggler_s", "mfu")},
        "worker_spread": sum(spreads) / len(spreads) if spreads else 0.0,
        "wall_s": last["wall_s"], "strategy_options": options,
        "worker_speeds": config.get("worker_speeds", ""), "speed_policy": config.get("speed_policy", "fixed"),
        "objective": config.get("objective", "sft"),
        **{k: v for key in ACCURACIES if key in last for k, v in ((f"{key}_start", rows[0].get(key)), (key, last[key]))},
        **{key: last[key] for key in TOTALS if key in last},
    }


def save(card: dict, run_dir) -> Path:
    path = Path(run_dir) / CARD
    path.write_text(json.dumps(card, indent=1))
    return path


def load(path) -> dict:
    """A scorecard from its file or its run folder (made from the run if it has none yet)."""
    path = Path(path)
    if path.is_dir():
        return json.loads((path / CARD).read_text()) if (path / CARD).exists() else scorecard(path)
    if not path.exists():
        raise ConfigError(f"{path} does not exist; pass scorecard.json files or run folders")
    card = read_json(path, "a scorecard", "pass scorecard.json files or run folders")
    if not isinstance(card, dict) or "final_eval_loss" not in card:
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


COLUMNS = [("run", "label", ""), ("workers", "workers", ""), ("eval loss", "final_eval_loss", "loss"),
           ("steps to target", "steps_to_target", ""), ("time to target", "modelled_s_to_target", "s"),
           ("time", "modelled_s", "s"), ("sent/worker", "bytes_sent_per_worker", "bytes"),
           ("peak exchange", "peak_exchange_bytes", "bytes"), ("utilisation", "utilisation", "%"),
           ("measured", "measured_utilisation", "%"), ("MFU", "mfu", "%"),
           ("worker spread", "worker_spread", "")]


# Shown where a scorecard has them (post-training's).
OBJECTIVE_COLUMNS = [("accuracy at start", "eval_accuracy_start", "points"), ("accuracy", "eval_accuracy", "points"),
                     ("pairs at start", "eval_pair_accuracy_start", "points"), ("pairs", "eval_pair_accuracy", "points"),
                     ("DPO reward accuracy", "eval_reward_accuracy", "points"),
                     ("generating", "generate_s", "s"), ("training", "train_s", "s")]


def table(cards: list) -> str:
    """A Markdown table of scorecards, one row each."""
    columns = COLUMNS + [c for c in OBJECTIVE_COLUMNS if any(card.get(c[1]) is not None for card in cards)]
    head = "| " + " | ".join(name for name, _, _ in columns) + " |"
    rule = "|" + "|".join("---" for _ in columns) + "|"
    rows = ["| " + " | ".join(fmt(c.get(key), kind) for _, key, kind in columns) + " |" for c in cards]
    return "\n".join([head, rule] + rows)


def describe(card: dict) -> str:
    """The scorecard in a few lines, for the terminal."""
    target = card["target_loss"]
    amount = (f"{fmt(card['tokens_to_target'])} tokens" if card["tokens_to_target"] is not None
              else f"{fmt(card.get('examples_to_target'))} examples")
    reach = (f"reached {target} at step {card['steps_to_target']} ({amount}, "
             f"{fmt(card['modelled_s_to_target'], 's')} modelled)" if card["steps_to_target"]
             else f"did not reach {target}" if target is not None else "no target")
    return "\n".join([
        f"{card['problem'] or 'run'}: {card['label']}, {card['workers']} workers -> {card['run_dir']}",
        f"  final eval loss {card['final_eval_loss']:.4f}; {reach}",
        f"  modelled time {fmt(card['modelled_s'], 's')} on {card['link']}, utilisation {fmt(card['utilisation'], '%')}"
        + (f", idle waiting for slower workers {fmt(card['idle_fraction'], '%')}" if card["idle_fraction"] else ""),
        f"  measured here: {time_spent(card)}",
        f"  sent per worker {fmt(card['bytes_sent_per_worker'], 'bytes')}, largest exchange "
        f"{fmt(card['peak_exchange_bytes'], 'bytes')}; worker spread (eval loss max - min) {card['worker_spread']:.4f}",
    ] + [f"  {card['objective']}: {post_training(card)}"] * (card.get("objective", "sft") != "sft"))


def post_training(card: dict) -> str:
    """A post-training run's held-out accuracies, start to end, and its generation, in a line."""
    said = {"eval_accuracy": "held-out accuracy (greedy)", "eval_pair_accuracy": "held-out pairs chosen over rejected",
            "eval_reward_accuracy": "DPO reward accuracy"}
    parts = [f"{said[key]} {fmt(card[f'{key}_start'], 'points')} -> {fmt(card[key], 'points')}"
             for key in ACCURACIES if card.get(key) is not None]
    if card.get("tokens_generated") is not None:
        parts.append(f"{fmt(card['tokens_generated'])} tokens generated; per worker {fmt(card['generate_s'], 's')} "
                     f"generating, {fmt(card['train_s'], 's')} training")
    return "; ".join(parts)


def time_spent(s: dict) -> str:
    """Where a run's time went as measured, and its MFU, in a line (a scorecard, a summary)."""
    if s.get("measured_utilisation") is None:  # a run from before these were measured
        return "-"
    return (f"compute {fmt(s['busy_s'], 's')}, waiting for the link {fmt(s['link_s'], 's')}, for slower workers "
            f"{fmt(s['straggler_s'], 's')}" + (f", restarts {fmt(s['restart_s'], 's')}" if s.get("restart_s") else "")
            + f"; utilisation {fmt(s['measured_utilisation'], '%')}, MFU {fmt(s['mfu'], '%')}")


def plot(cards: list, out: Path, title: str = None) -> Path:
    """Eval loss against modelled time and against bytes sent, one curve per scorecard's run."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    runs = [(c, MetricsLog.read(c["run_dir"])) for c in cards]
    # post-training: its held-out accuracy, where every run has one; else the eval loss
    metric = next((k for k in ACCURACIES if all(k in r for _, rows in runs for r in rows)), "eval_loss")
    links = sorted({c["link"] for c in cards})
    keys = [("modelled_time_s", "modelled wall-clock (s)" + (f" on {links[0]}" if len(links) == 1 else "")),
            ("bytes_sent_per_worker", "bytes sent per worker"), amount_axis(runs)]
    curves = [(c["label"] + (f" on {c['link']}" if len(links) > 1 else ""), rows) for c, rows in runs]
    for ax, (key, name) in zip(axes, keys):
        loss_curves(ax, curves, key, name, metric)
        ax.set_ylabel("eval loss (global model)" if metric == "eval_loss" else f"{metric} (global model)")
    targets = {c["target_loss"] for c in cards if c.get("target_loss") is not None}
    for ax in axes:
        for t in targets:
            ax.axhline(t, color="grey", linestyle=":", linewidth=1)
    axes[0].legend(fontsize=8)
    return save_figure(fig, out, title)
