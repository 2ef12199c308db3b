"""The Python API: train any MLX model with any strategy, in a few lines.

    from mlx_diloco import Trainer, DiLoCo
    result = Trainer(model, loss_fn, (X, Y), (X_eval, Y_eval), batch_size=16).fit(
        strategy=DiLoCo(sync_every=100), workers=4, steps=2000)
    result.model, result.metrics, result.bytes_sent, result.modelled_time("wifi")

`loss_fn(model, x, y)` returns a scalar (the mlx-lm convention). The Trainer's settings are the
config's keys (config.TrainConfig: batch_size, lr, warmup, precision, grad_checkpoint, seq_len, ...),
defaulting to `sim`'s: warmup -1 is a fifth of the run, at most 50 steps. Data is a tuple of arrays
(inputs, targets) split along the first axis, or an iterable of (x, y) batches. The run is the
same as `mlx-diloco sim`'s (training/run.py's Run): progress, metrics.jsonl, checkpoints and resume;
`fit(callbacks=[...])` adds observers of it (training/callbacks.py's TrainingCallback).

`model` is an `nn.Module`, or what rebuilds one in another process: a preset name, a preset file,
an mlx-lm model folder or an importable builder 'package.module:function'. Given one of those, an
importable `loss_fn` and arrays, `fit` trains in K processes as `sim` does (one per core on a CPU).
"""

import atexit
import copy
import json
import shutil
import tempfile
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
import numpy as np

from .config import OBJECTIVES, ConfigError, TrainConfig, held_out_in_sequences
from .data.datasets import ArrayExamples, BatchStream, Dataset
from .exchange.comm import SimCommunicator
from .exchange.ledger import ExchangeLedger
from .exchange.network import modelled_time, parse_link
from .tools.export import global_parameters, trained_model
from .models.zoo import build_model, load_spec
from .options import AUTO, did_you_mean, from_dict
from .records import META, SUMMARY
from .strategies import Strategy, make_strategy
from .training import checkpoint
from .training.metrics import MetricsLog
from .training.processes import choose_processes, run_processes, simulate
from .training.resolve import Parts, strategy_for_job
from .training.run import Run
from .training.workers import check_loss


def examples(data, what: str, sequences: int = None):
    """(inputs, targets) arrays -> ArrayExamples; an iterable of batches -> a BatchStream (training)
    or its first batches holding `sequences` examples, joined (evaluation: the run takes the first
    `sequences` of them)."""
    if isinstance(data, tuple) and len(data) == 2:
        return ArrayExamples(np.asarray(data[0]), np.asarray(data[1]))
    if sequences is None:
        return BatchStream(data)
    taken, held = [], 0
    for batch in data:
        if held >= sequences:
            break
        taken.append(batch)
        held += len(batch[0])
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
        return modelled_time(self.summary[SUMMARY.compute_s], self.exchanges, self.step_s, parse_link(link))


def as_strategy(strategy) -> Strategy:
    """`strategy` as given, or made from its name with its defaults ('diloco', as `sim --strategy diloco`)."""
    if isinstance(strategy, str):
        return make_strategy(strategy, {})
    if isinstance(strategy, Strategy):
        return strategy
    what = f"the class {strategy.__name__}; write {strategy.__name__}()" if isinstance(strategy, type) \
        else f"{type(strategy).__name__} {str(strategy)[:40]}"
    raise ConfigError(f"strategy must be a strategy such as DiLoCo(sync_every=50), or its name 'diloco', not {what}")


def check_data_path(model, eval_data, loss_fn=None):
    """Data named by path comes with its held-out split (valid.jsonl) and is tokenized by the model's
    tokenizer: the model must be named by path too, and a loss_fn by its import name (`sim` runs it)."""
    if not isinstance(model, str):
        raise ConfigError("train_data given as a path is read with the model's tokenizer: give the model as a "
                          "model folder or preset name (and tokenizer=FOLDER where it has none)")
    if eval_data is not None:
        raise ConfigError("train_data given as a path holds its own held-out split (valid.jsonl beside train.jsonl); "
                          "drop eval_data")
    if loss_fn is not None and not importable(loss_fn):
        raise ConfigError("train_data given as a path is trained as sim trains it, which imports loss_fn: define it "
                          "at the top level of a module")


def check_objective(objective: str, loss_fn, data_path):
    """A post-training objective brings its own loss (as `sim` refuses --loss with it) and reads its
    pairs or prompts from JSONL, through the model's tokenizer: arrays and batches are sft's."""
    if objective not in OBJECTIVES or objective == "sft":
        return  # (an unknown one: the config's check names it)
    if loss_fn is not None:
        raise ConfigError(f"loss_fn is the sft objective's; objective {objective} has its own loss: pass loss_fn=None")
    if data_path is None:
        raise ConfigError(f"objective {objective} reads its {'prompts' if objective == 'grpo' else 'preference pairs'} "
                          "from JSONL through the model's tokenizer: give train_data as a .jsonl file or folder and "
                          "the model as a model folder (docs/post-training.md); arrays and batches train objective sft")


def importable(fn) -> str:
    """'package.module:function' if a fresh process can import `fn` under that name, else ''."""
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or module == "__main__" or "." in name or "<" in name:
        return ""
    try:
        import importlib
        return f"{module}:{name}" if getattr(importlib.import_module(module), name, None) is fn else ""
    except ImportError:
        return ""


# The config keys a Trainer does not take as settings: its and fit's own arguments say them.
ARGUMENTS = {"model": "model", "data": "train_data", "loss": "loss_fn", "strategy": "fit's strategy",
             "strategy_options": "fit's strategy"}


def trainer_config(given: dict) -> TrainConfig:
    """A Trainer's settings as a config (sim's defaults for the rest): any config key but those
    the Trainer's arguments give; an unknown name or a wrong type is one line."""
    keys = [f.name for f in fields(TrainConfig) if f.name not in ARGUMENTS]
    given = held_out_in_sequences(given)
    for key in given:
        if key in ARGUMENTS:
            raise ConfigError(f"'{key}' is not a Trainer setting; pass it as {ARGUMENTS[key]}")
        if key not in keys:
            raise ConfigError(f"unknown Trainer setting '{key}'; {did_you_mean(key, keys)}")
    return from_dict(TrainConfig, {**given, "model": "api", "data": "api"}, what="Trainer setting")


class Trainer:
    def __init__(self, model, loss_fn, train_data, eval_data=None, *, run_dir=None, log=print, **settings):
        """`settings`: any config key (batch_size=16, lr=3e-4, precision="bf16", seq_len=..., workers,
        steps, ...); `fit`'s workers and steps, where given, override the last two."""
        self.model, self.loss_fn, self.run_dir, self.log = model, loss_fn, run_dir, log
        self.config = trainer_config(settings)
        self.said_one_process = False
        # Data named by path (JSONL: post-training's pairs or prompts, mlx-lm's records) is read as sim reads it.
        self.data_path = train_data if isinstance(train_data, (str, Path)) else None
        check_objective(self.config.objective, loss_fn, self.data_path)
        if self.data_path is not None:
            check_data_path(model, eval_data, loss_fn)
            return
        self.train = examples(train_data, "train_data")
        # Without eval data the training data is evaluated (pass eval_data when train_data is a one-shot generator).
        self.eval = examples(train_data if eval_data is None else eval_data, "eval_data",
                             sequences=self.config.eval_sequences)

    def trained_values(self) -> int:
        """The values the model trains (what a sync exchanges)."""
        model = self.built_model(self.config.seed) if isinstance(self.model, str) else self.model
        return sum(v.size for _, v in tree_flatten(model.trainable_parameters()))

    def fit(self, strategy, workers: int = None, steps: int = None, resume: bool = False, run_dir=None,
            processes: int = 0, callbacks=None) -> FitResult:
        """Train `workers` simulated replicas (default: the Trainer's setting, else sim's) for `steps`
        inner steps each with `strategy` (e.g. DiLoCo(sync_every=50), or a name: 'diloco'), in
        `run_dir` (default: the Trainer's run_dir, else a new temporary folder, removed when Python
        exits); `resume` continues a run there. `processes`: K processes of workers/K replicas (0:
        as `sim` chooses, where the model can be rebuilt). `callbacks`: TrainingCallbacks that hear
        the run's reports (training/callbacks.py; they keep the run in this process)."""
        strategy = as_strategy(strategy)
        config = replace(self.config, workers=self.config.workers if workers is None else workers,
                         steps=self.config.steps if steps is None else steps, strategy=strategy.name,
                         strategy_options=strategy.options())
        values = self.trained_values() if getattr(strategy, "sync_every", None) == AUTO else None
        strategy, config, notes = strategy_for_job(strategy, config, values, api=True)  # auto: the run records their numbers
        for note in notes:
            self.log(note)
        config.check_values()  # and against the strategy: where the run gets it (Run, or resolve in processes)
        if self.data_path is not None:
            return self.fit_from_files(config, self.folder(run_dir, strategy), processes, resume, callbacks)
        # every fit starts from the same initial weights; bad input is found before a run folder exists
        model = self.built_model(config.seed) if isinstance(self.model, str) else copy.deepcopy(self.model)
        if self.loss_fn is not None:
            check_loss(self.loss_fn, model, *self.eval.get(np.arange(min(config.batch_size, len(self.eval)))))
        run_dir = self.folder(run_dir, strategy)
        K = choose_processes(config.workers, processes, run_dir, resume)
        if K > 1 and (why := self.why_one_process(callbacks)):
            if processes or not self.said_one_process:
                self.log(f"training in one process: {why}")
            self.said_one_process, K = True, 1
        if K > 1:
            return self.fit_in_processes(config, run_dir, K, resume, model)
        if isinstance(self.train, BatchStream):
            self.train = BatchStream(self.train.batches)  # a fresh cursor for every fit
        data = Dataset(self.train, self.eval)
        parts = Parts(model, data, copy.deepcopy(strategy), loss=self.loss_fn)
        run = Run(config, run_dir, SimCommunicator(config.workers), resume=resume, log=self.log, parts=parts,
                  callbacks=callbacks)
        summary = run.train()
        model.update(run.global_params())
        mx.eval(model.parameters())
        return FitResult(model, MetricsLog.read(run_dir), run.ledger.bytes_sent, summary, run_dir,
                         run.ledger.log, run.compute_s / max(run.steps_done, 1))

    def folder(self, run_dir, strategy) -> Path:
        """The run folder: fit's, the Trainer's, else a new temporary one (it goes when Python exits)."""
        if not (run_dir or self.run_dir):
            run_dir = tempfile.mkdtemp(prefix=f"mlx-diloco-{strategy.name}-")
            atexit.register(shutil.rmtree, run_dir, ignore_errors=True)
        return Path(run_dir or self.run_dir)

    def fit_from_files(self, config: TrainConfig, run_dir: Path, processes: int, resume: bool, callbacks) -> FitResult:
        """`sim` on the model and data the Trainer names by path (callbacks: in one process); the
        model that comes back is the trained one (a fine-tune's base with its adapters)."""
        config = replace(config, model=str(self.model), data=str(self.data_path),
                         loss=importable(self.loss_fn) if self.loss_fn is not None else "")
        simulate(config, run_dir, 1 if callbacks else processes, resume, log=self.log, callbacks=callbacks)
        return self.result(run_dir, trained_model(run_dir))

    def built_model(self, seed: int):
        """The model the Trainer names (a preset, folder or builder), initialised from `seed`."""
        return build_model(load_spec(self.model), seed=seed)

    def why_one_process(self, callbacks=None) -> str:
        """Why the replicas cannot be trained in other processes ('' if they can)."""
        if callbacks:
            return "callbacks hear the run in this process"
        if not isinstance(self.model, str):
            return ("the model is an object; give Trainer a preset name, a model folder or a builder "
                    "'package.module:function' to train in several processes")
        if self.loss_fn is not None and not importable(self.loss_fn):
            return "loss_fn cannot be imported by another process (define it at the top level of a module)"
        if isinstance(self.train, BatchStream):
            return "the training data is an iterable of batches (give (inputs, targets) arrays)"
        return ""

    def fit_in_processes(self, config: TrainConfig, run_dir: Path, K: int, resume: bool, model) -> FitResult:
        """`sim --processes K` on the Trainer's parts: the arrays go to a file in the run folder;
        `model` (as built here) gets the trained weights."""
        data_file = run_dir / "data.npz"
        if not resume:
            run_dir.mkdir(parents=True, exist_ok=True)
            np.savez(data_file, train_inputs=self.train.inputs, train_targets=self.train.targets,
                     eval_inputs=self.eval.inputs, eval_targets=self.eval.targets)
        loss = importable(self.loss_fn) if self.loss_fn is not None else ""
        config = replace(config, model=self.model, data=str(data_file), loss=loss)
        run_processes(config, run_dir, K, resume=resume, log=self.log)
        arrays, meta = checkpoint.load(run_dir, log=lambda m: None)
        model.update(global_parameters(model, arrays, meta))
        mx.eval(model.parameters())
        return self.result(run_dir, model, meta)

    @staticmethod
    def result(run_dir: Path, model, meta: dict = None) -> FitResult:
        """The FitResult of a run another process (or `simulate`) trained, from its folder (and its
        last checkpoint's `meta` where the caller has read it)."""
        meta = meta or checkpoint.load(run_dir, log=lambda m: None)[1]
        summary = json.loads((run_dir / "summary.json").read_text())
        ledger = ExchangeLedger.from_state(meta[META.exchanges])
        return FitResult(model, MetricsLog.read(run_dir), summary[SUMMARY.bytes_sent_per_worker], summary, run_dir,
                         ledger.log, meta[META.compute_s] / max(meta[META.step], 1))
