"""What DPO and ORPO share: batches of preference pairs (data/post_training.py: B chosen rows, then
their B rejected rows), and the held-out pairs' metrics.

Held out, the global model's: `eval_pair_accuracy`, the share of pairs whose chosen completion it
gives a higher log-probability (summed over the completion's tokens) than the rejected one: the
reference-free accuracy, meaningful before any training too (DPO's implicit-reward accuracy is 0
there: the policy is the reference, every pair a tie). DPO adds its reward metrics (dpo.py).
"""

import time

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map

from ..data.jsonl import IGNORE
from .base import Context, Objective, Tally, completion_logps, members_of, with_params


def halves(values):
    """(chosen, rejected) of a pair batch's per-row values."""
    half = len(values) // 2
    return values[:half], values[half:]


class Preference(Objective):
    summary_keys = ("tokens_trained", "eval_pair_accuracy", "eval_logps_chosen")

    def __init__(self, config, model, data, log=print):
        super().__init__(config, model, data, log)
        self.beta = config.objective_beta()
        self.counts = None  # Tally, once the first batch says how many workers this process has

    def with_reference(self, workers, x, targets) -> dict:
        """The loss's batch (worker axis first) beside the targets: DPO adds the reference's
        log-probabilities."""
        return {"targets": targets}

    def batch(self, context: Context, x, y, tick):
        start = time.perf_counter()
        self.counts = self.counts or Tally(x.shape[0], ("tokens_trained", "reference_s"))
        batch = self.with_reference(context.workers, x, y)
        self.counts.add(members_of(tick, x.shape[0]), tokens_trained=np.array((y != IGNORE).sum(axis=(1, 2))),
                        reference_s=(time.perf_counter() - start) / x.shape[0])
        return x, batch

    def eval_batches(self, workers, batches):
        """Each held-out batch with what the loss needs beside its targets (computed once: the
        reference does not change)."""
        return [(x, tree_map(lambda a: a[0], self.with_reference(workers, mx.array(x)[None], mx.array(y)[None])))
                for x, y in batches]

    def report(self, context: Context) -> dict:
        row = {}
        if self.counts:
            every = self.counts.gather(context.comm)
            row = {"tokens_trained": int(sum(every["tokens_trained"])), "reference_s": float(np.mean(every["reference_s"]))}
        if not context.reporter:
            return row
        params = context.global_params()
        scores = [(np.array(with_params(context.workers, params, lambda m: completion_logps(
            m, mx.array(x), y["targets"])[0].sum(axis=-1))), y) for x, y in context.eval_batches]
        chosen, rejected = (np.concatenate(side) for side in zip(*(halves(s) for s, _ in scores)))
        return {**row, "eval_pair_accuracy": float(np.mean(chosen > rejected)),
                "eval_logps_chosen": float(chosen.mean()), "eval_logps_rejected": float(rejected.mean()),
                **self.held_out_metrics(scores)}

    def state(self) -> dict:
        return {"counts": self.counts.state()} if self.counts else {}

    def load_state(self, state: dict):
        if state:
            self.counts = Tally.from_state(state["counts"])

    def held_out_metrics(self, scores: list) -> dict:
        """More metrics of the held-out pairs from [(the global model's summed log-probabilities of each
        row, the batch's loss inputs)]."""
        return {}
