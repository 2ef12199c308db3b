"""`mlx-diloco sweep`: one run per point of a grid, a summary table and plots.

    mlx-diloco sweep --grid workers=1,2,4,8 --grid sync_every=10,50 --out runs/sweep

Grid keys are config keys or strategy options. Each point trains in its own folder (named by
its values) and gets a scorecard; the table (sweep.md) and plots are rewritten after every point.
Run the same command again to resume an interrupted sweep: finished points are kept, a point cut
off mid-run continues from its last checkpoint.
"""

import itertools
import json
import shutil
from pathlib import Path

from ..config import ConfigError, TrainConfig
from ..tools.plot import save_figure, spread_axis, value_axis
from ..records import CARD, ROW
from ..run_folder import latest_step
from ..strategies import without_other_options
from . import scorecard


def parse_grid(specs: list) -> dict:
    """['sync_every=10,50', 'strategy=diloco,ddp'] -> {'sync_every': [10, 50], 'strategy': ['diloco', 'ddp']}"""
    grid = {}
    for spec in specs:
        key, sep, values = spec.partition("=")
        if not sep or not values:
            raise ConfigError(f"grid '{spec}' must be KEY=V1,V2,... (e.g. sync_every=10,50)")
        grid[key.strip().replace("-", "_")] = [value(v.strip()) for v in values.split(",")]
    return grid


def value(text: str):
    try:
        return json.loads(text)  # 10, 0.7, true
    except json.JSONDecodeError:
        return text              # diloco, int4


def grid_points(grid: dict) -> list:
    """Every combination of the grid's values, as dicts."""
    return [dict(zip(grid, combo)) for combo in itertools.product(*grid.values())]


def point_name(point: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in point.items()) or "base"


def run_sweep(base: dict, points: list, out: Path, train, problem=None, target_loss: float = None,
              log=print) -> list:
    """Train every point (a dict of keys laid over `base`; `train(config, run_dir, resume)` returns
    when the run is done) and return the scorecards, scored against the problem's target loss
    (or `target_loss`). Every point's config is checked before the first one trains."""
    from ..training.resolve import resolve
    out = Path(out)
    # a point keeps its own strategy's options: a sweep over strategies=diloco,ddp drops H for ddp
    merged = [{**base, **p} for p in points]
    configs = [(p, TrainConfig.from_dict(without_other_options(c, c.get("strategy", TrainConfig.strategy))))
               for p, c in zip(points, merged)]
    for _, config in configs:
        resolve(config)  # and against its model (a preset's name, its context), before anything is written
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps({"base": base, "points": points}, indent=1))
    cards = []
    for i, (point, config) in enumerate(configs, 1):
        run_dir = out / point_name(point)
        if (run_dir / "summary.json").exists():
            log(f"[{i}/{len(configs)}] {point_name(point)}: done before, kept")
        else:
            resume = latest_step(run_dir) is not None
            if run_dir.exists() and not resume:
                shutil.rmtree(run_dir)  # cut off before its first checkpoint: start it again
            log(f"[{i}/{len(configs)}] {point_name(point)}" + (": resuming" if resume else ""))
            train(config, run_dir, resume)
        card = scorecard.scorecard(run_dir, problem, target_loss)
        card[CARD.point] = point
        card[CARD.label] = f"{point_name(point)}: {card[CARD.label]}"  # points can differ in what the label omits
        scorecard.save(card, run_dir)
        cards.append(card)
        write_summary(cards, out)
    return cards


def write_summary(cards: list, out: Path):
    """sweep.md (a table), and the plots: final eval loss against each numeric key of the points,
    and eval loss against modelled wall-clock for every point."""
    keys = list(dict.fromkeys(k for c in cards for k in c[CARD.point]))
    head = "| " + " | ".join(keys + ["eval loss", "steps to target", "time to target", "time", "sent/worker"]) + " |"
    lines = [head, "|" + "---|" * (len(keys) + 5)]
    for c in cards:
        lines.append("| " + " | ".join([str(c[CARD.point].get(k, "-")) for k in keys] + [
            scorecard.fmt(c[CARD.final_eval_loss], "loss"), scorecard.fmt(c[CARD.steps_to_target]),
            scorecard.fmt(c[CARD.modelled_s_to_target], "s"), scorecard.fmt(c[CARD.modelled_s], "s"),
            scorecard.fmt(c[CARD.bytes_sent_per_worker], "bytes")]) + " |")
    (out / "sweep.md").write_text("\n".join(lines) + "\n")
    plot(cards, keys, out / "sweep.png")


def plot(cards: list, keys: list, out: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from ..training.metrics import MetricsLog

    def number(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    numeric = [k for k in keys if len({c[CARD.point].get(k) for c in cards}) > 1
               and all(number(c[CARD.point].get(k)) for c in cards)]
    fig, axes = plt.subplots(1, len(numeric) + 1, figsize=(5.5 * (len(numeric) + 1), 4.5), squeeze=False)
    axes = axes[0]
    for ax, key in zip(axes, numeric):  # final loss against this key, one line per value of the others
        others = [k for k in keys if k != key]
        lines = {}
        for c in cards:
            lines.setdefault(tuple(c[CARD.point].get(k) for k in others), []).append(
                (c[CARD.point][key], c[CARD.final_eval_loss]))
        for rest, xy in lines.items():
            xy.sort()
            ax.plot([x for x, _ in xy], [y for _, y in xy], marker="o",
                    label=", ".join(f"{k}={v}" for k, v in zip(others, rest)) or None)
        ax.set_xlabel(key)
        ax.set_ylabel("final eval loss")
        value_axis(ax, [c[CARD.point][key] for c in cards])
        ax.grid(alpha=0.3)
        if others:
            ax.legend(fontsize=7)
    ax, times = axes[-1], []
    for c in cards:
        rows = MetricsLog.read(c[CARD.run_dir])
        times += [r[ROW.modelled_time_s] for r in rows]
        ax.plot([r[ROW.modelled_time_s] for r in rows], [r[ROW.eval_loss] for r in rows], marker=".",
                label=point_name(c[CARD.point]))
    links = sorted({c[CARD.link] for c in cards})
    ax.set_xlabel("modelled wall-clock (s) " + (f"on {links[0]}" if len(links) == 1 else "on each point's link"))
    ax.set_ylabel("eval loss")
    spread_axis(ax, times)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    return save_figure(fig, out)
