"""`mlx-diloco plot`: eval-loss curves of runs against steps, tokens and modelled time (PNG)."""

from pathlib import Path

from .config import ConfigError
from .training.metrics import MetricsLog

AXES = [("step", "inner steps"), ("tokens", "tokens (all workers)"), ("modelled_time_s", "modelled time (s)"),
        ("bytes_sent_per_worker", "bytes sent per worker")]


def run_label(rows, path) -> str:
    r = rows[-1]
    label = f"{r['strategy']} x{r['workers']}"
    if r.get("sync_every"):
        label += f" H={r['sync_every']}"
    return f"{label} ({Path(path).name})"


def plot_runs(run_dirs, out: Path, title: str = None) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = []
    for d in run_dirs:
        path = Path(d) / "metrics.jsonl" if Path(d).is_dir() else Path(d)
        if not path.exists():
            raise ConfigError(f"no metrics.jsonl in {d}; pass run folders written by 'mlx-diloco sim'")
        runs.append((d, MetricsLog.read(path)))
    fig, axes = plt.subplots(1, len(AXES), figsize=(5 * len(AXES), 4), sharey=True)
    for ax, (key, name) in zip(axes, AXES):
        for d, rows in runs:
            ax.plot([r[key] for r in rows], [r["eval_loss"] for r in rows], marker=".", label=run_label(rows, d))
        ax.set_xlabel(name)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("eval loss (global model)")
    axes[0].legend(fontsize=8)
    return save_figure(fig, out, title)


def save_figure(fig, out: Path, title: str = None) -> Path:
    """Write a matplotlib figure as a PNG (its folder made if need be) and close it."""
    import matplotlib.pyplot as plt
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
