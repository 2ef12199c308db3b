"""The Python API: train any MLX model with any strategy, in a few lines.

    from mlx_diloco import Trainer, DiLoCo
    result = Trainer(model, loss_fn, (X, Y), (X_eval, Y_eval), batch_size=16).fit(
        strategy=DiLoCo(sync_every=100), workers=4, steps=2000)
    result.model, result.metrics, result.bytes_sent, result.modelled_time("wifi")

`loss_fn(model, x, y)` returns a scalar (the mlx-lm convention). Data is a tuple of arrays
(inputs, targets) split along the first axis, or an iterable of (x, y) batches. The run is the
same as `mlx-diloco sim`'s (train.Run): progress, metrics.jsonl, checkpoints and resume.
"""

import copy
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from .config import ConfigError, TrainConfig, from_dict
from .data.datasets import ArrayExamples, BatchStream, Dataset
from .exchange.comm import SimCommunicator
from .exchange.network import modelled_time, parse_link
from .training.metrics import MetricsLog
from .training.run import Parts, Run


def examples(data, what: str, batches: int = None):
    """(inputs, targets) arrays -> ArrayExamples; an iterable of batches -> a BatchStream (training)
    or the first `batches` batches, joined (evaluation)."""
    if isinstance(data, tuple) and len(data) == 2:
        return ArrayExamples(np.asarray(data[0]), np.asarray(data[1]))
    if batches is None:
        return BatchStream(data)
    taken = [b for b, _ in zip(data, range(batches))]
    if not taken:
        raise ConfigError(f"{what} holds no batch; give (inputs, targets) arrays or an iterable of (x, y) batches")
    return ArrayExamples(*(np.concatenate([np.asarray(b[i]) for b in taken]) for i in (0, 1)))


@dataclass
class FitResult:
    model: object                  # the trained (global) model
    metrics: list                  # metric rows, as in metrics.jsonl
    bytes_sent: int                # by one worker
    summary: dict
    run_dir: Path
    exchanges: list = field(default_factory=list)  # (hops, sent bytes, overlap steps) of every exchange
    step_s: float = 0.0            # measured compute time of one inner step of one worker

    def modelled_time(self, link: str) -> float:
        """Seconds the run would take on `link` (a preset or 'BW/LATENCY'): compute, plus the
        part of each exchange that overlapped steps do not hide."""
        return modelled_time(self.summary["compute_s"], self.exchanges, self.step_s, parse_link(link))


class Trainer:
    def __init__(self, model, loss_fn, train_data, eval_data=None, batch_size: int = 16, *, lr: float = 1e-3,
                 warmup: int = 50, weight_decay: float = 0.1, grad_clip: float = 1.0, eval_batches: int = 8,
                 eval_every: int = 0, seed: int = 0, link: str = "1gbe", run_dir=None, log=print):
        self.model, self.loss_fn, self.run_dir, self.log = model, loss_fn, run_dir, log
        self.train = examples(train_data, "train_data")
        # Without eval data the training data is evaluated (pass eval_data when train_data is a one-shot generator).
        self.eval = examples(train_data if eval_data is None else eval_data, "eval_data", batches=eval_batches)
        self.settings = dict(batch_size=batch_size, lr=lr, warmup=warmup, weight_decay=weight_decay,
                             grad_clip=grad_clip, eval_batches=eval_batches, eval_every=eval_every, seed=seed, link=link)

    def fit(self, strategy, workers: int = 4, steps: int = 1000, resume: bool = False, run_dir=None) -> FitResult:
        """Train `workers` simulated replicas for `steps` inner steps each with `strategy`, in `run_dir`
        (default: the Trainer's run_dir, else a new temporary folder); `resume` continues a run there."""
        config = from_dict(TrainConfig, {**self.settings, "workers": workers, "steps": steps, "model": "api",
                                         "data": "api", "strategy": strategy.name}, what="Trainer option")
        config.strategy_options = strategy.options()
        config.check_values()
        run_dir = Path(run_dir or self.run_dir or tempfile.mkdtemp(prefix=f"mlx-diloco-{strategy.name}-"))
        if isinstance(self.train, BatchStream):
            self.train = BatchStream(self.train.batches)  # a fresh cursor for every fit
        data = Dataset(self.train, self.eval)
        model = copy.deepcopy(self.model)  # every fit starts from the same initial weights
        parts = Parts(model, data, copy.deepcopy(strategy), loss=self.loss_fn)
        run = Run(config, run_dir, SimCommunicator(workers), resume=resume, log=self.log, parts=parts)
        summary = run.train()
        model.update(run.global_params())
        mx.eval(model.parameters())
        return FitResult(model, MetricsLog.read(run_dir), run.bytes_sent, summary, run_dir,
                         run.exchange_log, run.compute_s / max(run.step, 1))
