"""`mlx-diloco plot`: eval-loss curves of runs against steps, tokens and modelled time (PNG)."""

import json
import math
from pathlib import Path

from ..config import ConfigError
from ..objectives.kinds import DEFAULT, kind
from ..records import ROW
from ..training.metrics import MetricsLog


def label(strategy: str, options: dict, config: dict) -> str:
    """A short name for a run: the strategy's label (what its options set apart), its pacing and
    membership schedule, and its objective where it is not SFT."""
    from ..strategies import make_strategy  # on call: the strategies import MLX
    try:
        parts = [make_strategy(strategy, options).label()]
    except ConfigError:  # a strategy this process has not registered (a user's own): its name
        parts = [strategy]
    if config.get("worker_speeds"):
        parts.append(f"{config.get('speed_policy', 'fixed')}-paced")
    if config.get("membership"):
        parts.append(f"members {config['membership']}")
    if kind(objective := config.get("objective", DEFAULT)).post_training:  # (objectives/)
        parts.append(objective)
    return " ".join(parts)


def run_label(rows, path) -> str:
    """'diloco x2 H=10 P=2 tau=2 int4 (run folder)': what sets the run apart, and where it is."""
    r = rows[-1]
    config_file = Path(path) / "config.json" if Path(path).is_dir() else Path(path).parent / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    strategy, *rest = label(r[ROW.strategy], r.get(ROW.strategy_options) or {}, config).split(" ", 1)
    return " ".join([f"{strategy} x{r[ROW.workers]}", *rest, f"({Path(path).name})"])


def amount_axis(runs) -> tuple:
    """(metrics key, axis name) of what the runs trained on: tokens, or examples (images, rows)
    when a run's data is not tokens."""
    if all(r.get(ROW.tokens) is not None for _, rows in runs for r in rows):
        return ROW.tokens, "tokens (all workers)"
    return ROW.examples, "examples (all workers; the data is not tokens)"


def plot_runs(run_dirs, out: Path, title: str = None) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    check_image_name(out)
    runs = []
    for d in run_dirs:
        path = Path(d) / "metrics.jsonl" if Path(d).is_dir() else Path(d)
        if not path.exists():
            raise ConfigError(f"no metrics.jsonl in {d}; pass run folders written by 'mlx-diloco sim'")
        runs.append((d, MetricsLog.read(path)))
        if not runs[-1][1]:
            raise ConfigError(f"{path} holds no metrics yet; pass runs that have evaluated once")
    axes_keys = [(ROW.step, "inner steps"), amount_axis(runs), (ROW.modelled_time_s, "modelled time (s)"),
                 (ROW.bytes_sent_per_worker, "bytes sent per worker")]
    panels = [(key, name) for key, name in OBJECTIVE_PANELS if any(value_of(r, key) is not None
                                                                   for _, rows in runs for r in rows)]
    grid = 1 + -(-len(panels) // len(axes_keys))  # the eval loss's row, then the objective's metrics
    fig, axes = plt.subplots(grid, len(axes_keys), figsize=(5 * len(axes_keys), 4 * grid), squeeze=False)
    curves = [(run_label(rows, d), rows) for d, rows in runs]
    for ax, (key, name) in zip(axes[0], axes_keys):
        loss_curves(ax, curves, key, name)
        ax.sharey(axes[0][0])
    axes[0][0].set_ylabel("eval loss (global model)")
    for ax, (key, name) in zip(axes[1:].flat, panels):
        metric_curves(ax, curves, key, name)
    for ax in list(axes[1:].flat)[len(panels):]:
        ax.axis("off")
    axes[0][-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1))  # beside the panels, over no curve
    return save_figure(fig, out, title)


# Post-training's metrics (objectives/), each against inner steps, where a run has them.
GENERATE_SHARE = "generate_share"  # worked out from two of a row's keys (value_of)
OBJECTIVE_PANELS = [
    (ROW.eval_accuracy, "held-out accuracy (greedy, global model)"), (ROW.reward, "reward (mean since the last evaluation)"),
    (ROW.kl, "KL to the reference"), (ROW.frac_reward_zero_std, "share of groups with no advantage"),
    (ROW.completion_length, "completion length (tokens)"), (GENERATE_SHARE, "share of the step time generating"),
    (ROW.eval_pair_accuracy, "held-out pairs: chosen more likely"),
    (ROW.eval_reward_accuracy, "held-out pairs: DPO reward accuracy"),
    (ROW.eval_reward_margin, "held-out pairs: DPO reward margin")]


def value_of(row: dict, key: str):
    """A metrics row's value of `key`; generate_share: the time generating over generating and training."""
    if key == GENERATE_SHARE:
        generating, training = row.get(ROW.generate_s), row.get(ROW.train_s)
        return generating / (generating + training) if generating is not None and generating + training > 0 else None
    return row.get(key)


def metric_curves(ax, curves, key: str, name: str):
    """Metric `key` against inner steps, one curve per (label, metrics rows), where the rows have it."""
    for i, (label_of_run, rows) in enumerate(curves):  # each run the colour it has in the loss panels
        points = [(r[ROW.step], v) for r in rows if (v := value_of(r, key)) is not None]
        if points:
            ax.plot(*zip(*points), marker=".", label=label_of_run, color=run_colour(i),
                    linestyle="-" if i < colours() else "--")
    ax.set_xlabel("inner steps")
    ax.set_ylabel(name)
    ax.grid(alpha=0.3)


def loss_curves(ax, curves, key: str, name: str, metric: str = ROW.eval_loss):
    """Eval loss (or another `metric`) against metrics `key` (axis label `name`), one curve per (label,
    metrics rows); modelled time and bytes get a spread axis (they span decades from 0)."""
    for i, (name_of_run, rows) in enumerate(curves):  # once the colours come round again, dashed lines
        ax.plot([r[key] for r in rows], [r[metric] for r in rows], marker=".", label=name_of_run,
                color=run_colour(i), linestyle="-" if i < colours() else "--")
    ax.set_xlabel(name)
    ax.grid(alpha=0.3)
    if key in (ROW.modelled_time_s, ROW.bytes_sent_per_worker):
        spread_axis(ax, [r[key] for _, rows in curves for r in rows])


def colours() -> int:
    import matplotlib.pyplot as plt
    return len(plt.rcParams["axes.prop_cycle"])


def run_colour(i: int) -> str:
    """The colour of the i-th run's curves, in every panel."""
    return f"C{i % colours()}"


def check_image_name(out):
    """One line, before any work, when matplotlib cannot write a file of `out`'s extension."""
    from matplotlib.backend_bases import FigureCanvasBase
    kinds = FigureCanvasBase.get_supported_filetypes()
    if Path(out).suffix.lstrip(".").lower() not in kinds:
        raise ConfigError(f"cannot write a plot to '{out}': end --out in .png, or one of .{', .'.join(sorted(kinds))}")


def spread_axis(ax, values, decades: float = 1.0):
    """A logarithmic x axis when the positive `values` span more than `decades` decades (DDP's
    bytes against DiLoCo's), that keeps the curves' first point at 0 (step 0): linear from 0 to the
    power of ten below the smallest positive value, logarithmic above it (symlog; the axis label
    says so). Call after setting the label. Else the axis stays linear."""
    positive = [v for v in values if v > 0]
    if positive and max(positive) >= 10 ** decades * min(positive):
        threshold = 10.0 ** math.floor(math.log10(min(positive)))
        ax.set_xscale("symlog", linthresh=threshold, linscale=0.5)
        ax.set_xlabel(f"{ax.get_xlabel()}, log scale above {threshold:g}")


def value_axis(ax, values):
    """An x axis for a swept setting (H = 10, 20, 30; workers = 1, 2, 4, 8): a tick at each value,
    written as it was given; logarithmic (base 2) when the values span a factor of 4 or more."""
    xs = sorted(set(values))
    if min(xs) > 0 and max(xs) >= 4 * min(xs):
        ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [f"{x:g}" for x in xs])
    ax.minorticks_off()


def save_figure(fig, out: Path, title: str = None) -> Path:
    """Write a matplotlib figure as a PNG (its folder made if need be) and close it."""
    import matplotlib.pyplot as plt
    check_image_name(out)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120, bbox_inches="tight")  # a legend beside the axes included
    plt.close(fig)
    return out
