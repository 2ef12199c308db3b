"""What every objective shares: the interface the run calls (`Objective`, which is SFT: the data's own
next-token loss), what the run lends it (`Context`), the log-probabilities of a batch's completion
tokens, and the reference policy.

A run (training/run.py) asks its objective for these, each a no-op for SFT:
- `check_model(config, spec)` and `notes(config)`: before anything is loaded, a model it cannot
  train refused in one line, and what it changed of the config as given (training/resolve.py);
- `loss(model, x, y)`: the workers' loss (None: the data's own cross-entropy);
- `batch(context, x, y, tick)`: the step's batch from the data's, before the inner step: what it
  needs that depends on the policies now (the reference's log-probabilities, GRPO's rollouts and rewards);
- `eval_batches(workers, batches)`: the held-out batches, likewise;
- `report(context)`: the objective's metrics for the evaluation's row (every process calls it: it
  gathers the workers' values), and `summary_keys`, those of them the run's summary repeats;
- `state()` and `load_state()`: its running totals, in a checkpoint's meta.
"""

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ..data.jsonl import IGNORE
from ..models.kernels import token_cross_entropy


@dataclass
class Context:
    """What an objective may use of the run that trains it (Run builds it once its workers exist)."""
    workers: object             # training.workers.Workers: this process's replicas (their params, model)
    comm: object                # exchange.comm.Communicator: gather_metric collects every worker's values
    slots: list                 # the job's worker id of each local worker (its rollout seeds)
    reporter: bool              # this process reports the metrics rows (held-out metrics: its alone)
    global_params: Callable     # () -> the global model's parameters (no worker axis)
    eval_batches: list          # the held-out batches, as `eval_batches` prepared them


class Objective:
    """SFT: the data's next-token loss, nothing before the step, nothing more to report."""
    name = "sft"
    loss = None
    summary_keys = ()

    def __init__(self, config, model, data, log=print):
        self.config, self.data, self.log = config, data, log

    @classmethod
    def check_model(cls, config, spec):
        """Refuse, before any data is read, a model (models.zoo.ModelSpec) this objective cannot train."""

    @classmethod
    def notes(cls, config) -> list:
        """What this objective takes differently from the config as given, for the run to say once."""
        return []

    def batch(self, context: Context, x, y, tick):
        return x, y

    def eval_batches(self, workers, batches):
        return batches

    def report(self, context: Context) -> dict:
        return {}

    def state(self) -> dict:
        """What a checkpoint keeps of the objective (its meta: plain numbers): its running totals."""
        return {}

    def load_state(self, state: dict):
        pass


def completion_logps(model, x, targets, temperature: float = 1.0):
    """(each target's log-probability under model(x), its logits divided by `temperature` as TRL's
    GRPO does, 0 where the target is IGNORE; the mask of the others), shapes (rows, T)."""
    logits = model(x).astype(mx.float32)
    if temperature != 1.0:
        logits = logits / temperature
    scored = targets != IGNORE
    return -token_cross_entropy(logits, mx.where(scored, targets, 0)) * scored, scored


@contextmanager
def evaluating(model):
    """The model in eval mode inside (no adapter dropout): sampling and reference passes."""
    training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(training)


def with_params(workers, params, fn):
    """`fn(model)` with the workers' model holding `params` (no worker axis), evaluated, in eval mode;
    the model let go of them after (Workers.release)."""
    workers.model.update(params)
    try:
        with evaluating(workers.model) as model:
            out = fn(model)
            mx.eval([leaf for _, leaf in tree_flatten(out) if isinstance(leaf, mx.array)])
        return out
    finally:
        workers.release()


class Reference:
    """The policy the run started from, as DPO and GRPO's KL term compare against: the trainable
    parameters at the start. Under LoRA those are the fresh adapters (lora_b = 0), so the reference
    is the base model with no second copy of it (TRL's "adapters off"); under full fine-tuning, a
    frozen copy of the starting weights. A resumed run builds the same one (fresh adapters, the same
    starting model), and DiLoCo's rounds do not move it."""

    def __init__(self, model):
        self.params = model.trainable_parameters()

    def logps(self, workers, x, targets, temperature: float = 1.0) -> mx.array:
        """Per-token log-probabilities (workers, rows, T) of each worker's rows under the reference,
        one worker's rows at a time (one batch's logits in memory)."""
        return mx.stack([with_params(workers, self.params,
                                     lambda model: completion_logps(model, x[i], targets[i], temperature)[0])
                         for i in range(x.shape[0])])


class Tally:
    """Sums kept per local worker (numpy, (n_local, len(keys))) since the run started or since
    `clear`; `gather` gives every worker's, over the processes (a collective: every process calls it).
    What a worker does not take part in (a non-member's tick) is not added."""

    def __init__(self, n_local: int, keys):
        self.keys = list(keys)
        self.sums = np.zeros((n_local, len(self.keys)))

    def add(self, members, **values):
        """Add each worker's `values` (a sequence of n_local numbers, or one number for every worker)."""
        for key, value in values.items():
            added = np.broadcast_to(np.asarray(value, np.float64), (len(self.sums),))
            self.sums[:, self.keys.index(key)] += np.where(members, added, 0.0) if members is not None else added

    def gather(self, comm) -> dict:
        """{key: [every worker's sum]}."""
        every = comm.gather_metric(mx.array(self.sums))
        return {key: [row[k] for row in every] for k, key in enumerate(self.keys)}

    def clear(self):
        self.sums[:] = 0.0

    def state(self) -> dict:
        return {"keys": self.keys, "sums": self.sums.tolist()}

    @classmethod
    def from_state(cls, state: dict) -> "Tally":
        tally = cls(len(state["sums"]), state["keys"])
        tally.sums[:] = state["sums"]
        return tally


def members_of(tick, n_local: int) -> np.ndarray:
    """Which local workers take this tick's step (a membership schedule's members; else all)."""
    return np.ones(n_local, bool) if tick.members is None else np.asarray(tick.members, bool)
