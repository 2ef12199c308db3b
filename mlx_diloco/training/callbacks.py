"""Who hears what a run reports (mlx-lm's TrainingCallback shape, plus exchanges): the metrics
files, the progress bar, the agent's progress file, the loggers of report-to (wandb, swanlab,
through mlx-lm's own callbacks), and any logger a user passes to `Run(callbacks=...)` or
`Trainer.fit(callbacks=...)`. Each report is a dict of plain numbers.

    class Printer(TrainingCallback):
        def on_val_loss_report(self, info):
            print(info[ROW.step], info[ROW.eval_loss])     # from mlx_diloco.records import ROW

Each report's keys are declared in records.py: a train report's in PROGRESS, a metrics row's in
ROW, an exchange's in EXCHANGE, the summary's in SUMMARY.
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
from ..records import MLX_LM, PROGRESS, ROW, STATUS, SUMMARY
from ..run_status import StatusWriter, StepRate, passed
from .metrics import MetricsLog, human_bytes


class TrainingCallback:
    """Observes a run; every hook does nothing unless overridden."""

    def on_train_begin(self, info: dict):
        """Before `Run.train`'s first step: PROGRESS's step (steps done so far) and steps (the run's)."""

    def on_train_loss_report(self, info: dict):
        """After every step at which this process's workers trained (a slower worker may wait out
        a step: speeds.py): a train report (records.PROGRESS: the step, its losses, tokens per
        second, time waiting for exchanges, bytes sent, ...)."""

    def on_val_loss_report(self, info: dict):
        """At every evaluation, on the reporting process: the metrics row (metrics.jsonl, records.ROW:
        the global model's eval loss, each worker's, the train loss, tokens, ...)."""

    def on_sync_report(self, info: dict):
        """For every exchange that finished: its row (exchanges.jsonl, records.EXCHANGE)."""

    def on_train_end(self, summary: dict):
        """After `Run.train`'s last step: the run's summary (summary.json, records.SUMMARY)."""

    def on_train_stopped(self, info: dict):
        """`Run.train` stopped early, on an error or a request to stop: PROGRESS's step (steps done)."""


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
        self.bar = tqdm(total=info[PROGRESS.steps], initial=info[PROGRESS.step], file=sys.stderr,
                        desc=self.description, dynamic_ncols=True)

    def on_train_loss_report(self, info):
        if self.bar is None:  # steps taken one by one (Run.step), not by Run.train
            return
        self.bar.update(info[PROGRESS.step] - self.bar.n)
        self.bar.set_postfix(loss=f"{info[PROGRESS.loss]:.3f}", tok_s=f"{info[PROGRESS.job_tokens_per_s]:,.0f}",
                             sent=human_bytes(info[PROGRESS.bytes_sent]))

    def on_train_end(self, summary):
        self.bar.update(summary[SUMMARY.steps] - self.bar.n)  # with the steps a slower worker waited out
        self.bar.close()

    def on_train_stopped(self, info):
        self.bar.close()  # its line ended: what stopped the run is said on a line of its own


class ProgressFile(TrainingCallback):
    """A small JSON file rewritten at every step, which a cluster's agent reads to report on its worker
    (and the launcher, in turn, in the run's status.json: run_status.py)."""

    def __init__(self, path: str):
        self.path = path

    def on_train_loss_report(self, info):
        kept = (PROGRESS.step, PROGRESS.steps, PROGRESS.loss, PROGRESS.tokens_per_s)  # and passed's (time_s, ...)
        self.last = {**{k: info[k] for k in kept}, **passed(info)}
        atomic_write_text(self.path, json.dumps({**self.last, PROGRESS.time: time.time()}), durable=False)

    def on_train_end(self, summary):
        """The run's whole time split, its end included (the launcher's summary reads rank 0's)."""
        atomic_write_text(self.path, json.dumps({
            **getattr(self, "last", {}), PROGRESS.process_s: summary[SUMMARY.process_s],
            PROGRESS.time_s: summary[SUMMARY.time_s], PROGRESS.time: time.time()}), durable=False)


class StatusFile(TrainingCallback):
    """status.json (run_status.py) off a cluster: each worker this process trains, at most twice a
    second, in `folder` (the run folder, or worker-W for the other processes of sim --processes)."""

    def __init__(self, folder: Path, workers: list):
        self.writer, self.workers, self.rate = StatusWriter(folder, "sim"), workers, StepRate()
        self.host, self.rows = platform.node(), []

    def on_train_begin(self, info):
        self.rows = [{STATUS.worker: w, STATUS.host: self.host, STATUS.step: info[PROGRESS.step],
                      STATUS.state: "training"} for w in self.workers]
        self.writer.write(info[PROGRESS.step], info[PROGRESS.steps], self.rows, force=True)

    def on_train_loss_report(self, info):
        """A worker without a loss at this step did not train at it: it waits (a slower worker, or one
        out of the job until its turn in a membership schedule)."""
        if not self.writer.due():
            return
        step, trained = info[PROGRESS.step], sum(loss is not None for loss in info[PROGRESS.worker_losses])
        rate = self.rate("process", time.time(), step)
        self.rows = [STATUS.check({
            STATUS.worker: w, STATUS.host: self.host, STATUS.step: step, STATUS.steps_per_s: rate, STATUS.loss: loss,
            STATUS.state: "training" if loss is not None else "waiting",
            STATUS.tokens_per_s: info[PROGRESS.tokens_per_s] / trained if loss is not None else None, **passed(info)})
            for w, loss in zip(self.workers, info[PROGRESS.worker_losses])]
        self.writer.write(step, info[PROGRESS.steps], self.rows)

    def on_train_end(self, summary):
        steps = summary[SUMMARY.steps]
        rows = [{**row, STATUS.step: steps, STATUS.state: "done"} for row in self.rows]
        self.writer.write(steps, steps, rows, force=True)


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
    return MLX_LM.check({MLX_LM.iteration: info[PROGRESS.step], MLX_LM.train_loss: info[PROGRESS.loss],
                         MLX_LM.tokens_per_second: info[PROGRESS.job_tokens_per_s],
                         PROGRESS.sync_s: info[PROGRESS.sync_s], PROGRESS.bytes_sent: info[PROGRESS.bytes_sent]})


def mlx_lm_val_info(row: dict) -> dict:
    """An evaluation (a metrics row) in mlx-lm's keys (val_info, and train_info's trained_tokens and
    peak_memory in GB): the global model's loss as val_loss; of ours, the numbers a chart can show
    (not the per-worker lists, nor None)."""
    info = {MLX_LM.iteration: row[ROW.step], MLX_LM.val_loss: row[ROW.eval_loss],
            MLX_LM.trained_tokens: row.get(ROW.tokens), MLX_LM.peak_memory: row[ROW.peak_memory_bytes] / 1e9}
    info.update({key: row[key] for key in (ROW.bytes_sent_per_worker, ROW.utilisation, ROW.modelled_time_s, ROW.wall_s)})
    return {key: value for key, value in info.items() if value is not None}
