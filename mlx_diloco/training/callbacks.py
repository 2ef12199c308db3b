"""Who hears what a run reports (mlx-lm's TrainingCallback shape, plus exchanges): the metrics
files, the progress bar, the agent's progress file, the loggers of report-to (wandb, swanlab,
through mlx-lm's own callbacks), and any logger a user passes to `Run(callbacks=...)` or
`Trainer.fit(callbacks=...)`. Each report is a dict of plain numbers.

    class Printer(TrainingCallback):
        def on_val_loss_report(self, info):
            print(info["step"], info["eval_loss"])
"""

import importlib.util
import json
import platform
import sys
import time
from pathlib import Path

from tqdm import tqdm

from ..atomic import atomic_write_text
from ..options import ConfigError
from ..run_status import StatusWriter, StepRate, passed
from .metrics import MetricsLog, human_bytes


class TrainingCallback:
    """Observes a run; every hook does nothing unless overridden."""

    def on_train_begin(self, info: dict):
        """Before `Run.train`'s first step: {"step": steps done so far, "steps": the run's}."""

    def on_train_loss_report(self, info: dict):
        """After every step at which this process's workers trained (a slower worker may wait out
        a step: speeds.py): {"step", "steps", "loss": the mean of this step's local losses,
        "worker_losses": each local worker's (None for one that did not train at this step),
        "tokens_per_s": this process's, "job_tokens_per_s": the whole job's, "sync_s": time spent
        waiting for exchanges so far, "bytes_sent": by one worker so far}."""

    def on_val_loss_report(self, info: dict):
        """At every evaluation, on the reporting process: the metrics row (metrics.jsonl), with
        "eval_loss" (the global model's), "eval_loss_workers", "train_loss", "tokens", ..."""

    def on_sync_report(self, info: dict):
        """For every exchange that finished: {"step", "what", "codec", "algorithm", "payload_bytes",
        "sent_bytes", "overlap_steps", "modelled_s", "exposed_s", "blocked_s"} (exchanges.jsonl)."""

    def on_train_end(self, summary: dict):
        """After `Run.train`'s last step: the run's summary (summary.json)."""

    def on_train_stopped(self, info: dict):
        """`Run.train` stopped early, on an error or a request to stop: {"step": steps done}."""


class MetricsFile(TrainingCallback):
    """The run folder's metrics.jsonl (a row per evaluation), exchanges.jsonl (a row per exchange of
    a periodic strategy: per-step ones would write a row a step) and summary.json. A resumed run
    drops the rows written after its checkpoint: that work is being redone."""

    def __init__(self, run_dir: Path, exchanges: bool, resumed_at: int = None):
        self.run_dir = Path(run_dir)
        self.metrics = MetricsLog(self.run_dir / "metrics.jsonl")
        self.exchanges = MetricsLog(self.run_dir / "exchanges.jsonl") if exchanges else None
        if resumed_at is not None:
            for log in filter(None, (self.metrics, self.exchanges)):
                log.truncate_after(resumed_at)

    def on_val_loss_report(self, info):
        self.metrics.write(info)

    def on_sync_report(self, info):
        if self.exchanges:
            self.exchanges.write(info)

    def on_train_end(self, summary):
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))


class ProgressBar(TrainingCallback):
    """A tqdm bar on stderr: steps, the latest loss, the job's tokens per second, bytes sent."""

    def __init__(self, description: str):
        self.description, self.bar = description, None

    def on_train_begin(self, info):
        self.bar = tqdm(total=info["steps"], initial=info["step"], file=sys.stderr, desc=self.description,
                        dynamic_ncols=True)

    def on_train_loss_report(self, info):
        if self.bar is None:  # steps taken one by one (Run.step), not by Run.train
            return
        self.bar.update(info["step"] - self.bar.n)
        self.bar.set_postfix(loss=f"{info['loss']:.3f}", tok_s=f"{info['job_tokens_per_s']:,.0f}",
                             sent=human_bytes(info["bytes_sent"]))

    def on_train_end(self, summary):
        self.bar.update(summary["steps"] - self.bar.n)  # with the steps a slower worker waited out
        self.bar.close()

    def on_train_stopped(self, info):
        self.bar.close()  # its line ended: what stopped the run is said on a line of its own


class ProgressFile(TrainingCallback):
    """A small JSON file rewritten at every step, which a cluster's agent reads to report on its worker
    (and the launcher, in turn, in the run's status.json: run_status.py)."""

    def __init__(self, path: str):
        self.path = path

    def on_train_loss_report(self, info):
        atomic_write_text(self.path, json.dumps({
            "step": info["step"], "steps": info["steps"], "loss": info["loss"], "tokens_per_s": info["tokens_per_s"],
            **passed(info), "time": time.time()}), durable=False)


class StatusFile(TrainingCallback):
    """status.json (run_status.py) off a cluster: each worker this process trains, at most twice a
    second, in `folder` (the run folder, or worker-W for the other processes of sim --processes)."""

    def __init__(self, folder: Path, workers: list):
        self.writer, self.workers, self.rate = StatusWriter(folder, "sim"), workers, StepRate()
        self.host, self.rows = platform.node(), []

    def on_train_begin(self, info):
        self.rows = [{"worker": w, "host": self.host, "step": info["step"], "state": "training"} for w in self.workers]
        self.writer.write(info["step"], info["steps"], self.rows, force=True)

    def on_train_loss_report(self, info):
        """A worker without a loss at this step did not train at it: it waits (a slower worker, or one
        out of the job until its turn in a membership schedule)."""
        if not self.writer.due():
            return
        step, trained = info["step"], sum(loss is not None for loss in info["worker_losses"])
        rate = self.rate("process", time.time(), step)
        self.rows = [{"worker": w, "host": self.host, "step": step, "steps_per_s": rate, "loss": loss,
                      "state": "training" if loss is not None else "waiting",
                      "tokens_per_s": info["tokens_per_s"] / trained if loss is not None else None, **passed(info)}
                     for w, loss in zip(self.workers, info["worker_losses"])]
        self.writer.write(step, info["steps"], self.rows)

    def on_train_end(self, summary):
        rows = [{**row, "step": summary["steps"], "state": "done"} for row in self.rows]
        self.writer.write(summary["steps"], summary["steps"], rows, force=True)


class Loggers(TrainingCallback):
    """report-to's loggers (wandb, swanlab): mlx-lm's own callbacks (`get_reporting_callbacks`), fed
    our reports in their keys (`mlx_lm_train_info`, `mlx_lm_val_info`). The logger's run is named
    after the run folder and keeps its files there, as mlx_lm.lora's does after --adapter-path."""

    def __init__(self, config, run_dir: Path):
        from mlx_lm.tuner.callbacks import get_reporting_callbacks
        self.logger = get_reporting_callbacks(config.report_to, project_name=config.project_name or None,
                                              log_dir=str(run_dir), config=config.to_dict())

    def on_train_loss_report(self, info):
        self.logger.on_train_loss_report(mlx_lm_train_info(info))

    def on_val_loss_report(self, info):
        self.logger.on_val_loss_report(mlx_lm_val_info(info))


def check_loggers(config):
    """Before the run starts: report-to's packages are installed (optional extras), or one line."""
    for name in config.reporters():
        if importlib.util.find_spec(name) is None:
            raise ConfigError(f"report-to {name}: the {name} package is not installed; "
                              f"pip install {name} (or drop --report-to {name})")


def mlx_lm_train_info(info: dict) -> dict:
    """A train report in mlx-lm's keys (tuner/trainer.py's train_info): the step as its iteration,
    the whole job's tokens per second; ours beside them."""
    return {"iteration": info["step"], "train_loss": info["loss"], "tokens_per_second": info["job_tokens_per_s"],
            "sync_s": info["sync_s"], "bytes_sent": info["bytes_sent"]}


def mlx_lm_val_info(row: dict) -> dict:
    """An evaluation (a metrics row) in mlx-lm's keys (val_info, and train_info's trained_tokens and
    peak_memory in GB): the global model's loss as val_loss; of ours, the numbers a chart can show
    (not the per-worker lists, nor None)."""
    info = {"iteration": row["step"], "val_loss": row["eval_loss"], "trained_tokens": row.get("tokens"),
            "peak_memory": row["peak_memory_bytes"] / 1e9}
    info.update({key: row[key] for key in ("bytes_sent_per_worker", "utilisation", "modelled_time_s", "wall_s")})
    return {key: value for key, value in info.items() if value is not None}
