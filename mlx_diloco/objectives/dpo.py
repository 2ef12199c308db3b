"""DPO (Rafailov et al. 2023, arXiv 2305.18290), sigmoid loss, as TRL's DPOTrainer computes it:

    S(b)  = sum over the completion's tokens of log p(token)         (prompt and padding masked)
    delta = (S_policy(chosen) - S_ref(chosen)) - (S_policy(rejected) - S_ref(rejected))
    loss  = mean over pairs of -log sigmoid(beta * delta)            (beta: --beta, default 0.1)
            + alpha NLL(chosen)                                      (--rpo-alpha: RPO; 0 by default)

NLL(chosen) is the token mean of the chosen completions' cross-entropy over the batch, as TRL's
rpo_alpha adds it: DPO alone may raise the margin by lowering both answers, the chosen one too
(likelihood displacement); the NLL term holds the chosen answer up.

The reference is the policy the run started from (base.Reference: the base with the adapters as
made, under LoRA), its log-probabilities computed before the step, outside the gradient. Held out:
TRL's reward metrics, `eval_rewards_chosen` = mean beta (S_policy - S_ref) of the chosen completions
(and rejected), `eval_reward_margin` their mean difference, `eval_reward_accuracy` the share of
pairs whose chosen reward is the higher (per pair, not of the batch means as mlx-lm-lora has it).
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .base import Reference, completion_logps
from .preference import Preference, halves


def dpo_loss(model, x, y, beta: float, rpo_alpha: float = 0.0):
    """x: (2B, T), the B chosen sequences then their B rejected ones; y: {"targets": (2B, T) with
    IGNORE off the completions, "ref_logps": (2B,) the reference's summed log-probabilities}."""
    logps, scored = completion_logps(model, x, y["targets"])
    chosen, rejected = halves(logps.sum(axis=-1) - y["ref_logps"])
    loss = -nn.log_sigmoid(beta * (chosen - rejected)).mean()
    if rpo_alpha:
        chosen_logps, chosen_scored = halves(logps)[0], halves(scored)[0]
        loss = loss - rpo_alpha * chosen_logps.sum() / mx.maximum(chosen_scored.sum(), 1)
    return loss


class DPO(Preference):
    name = "dpo"
    summary_keys = Preference.summary_keys + ("eval_reward_accuracy", "eval_reward_margin")

    def __init__(self, config, model, data, log=print):
        super().__init__(config, model, data, log)
        self.reference = Reference(model)

    def loss(self, model, x, y):
        return dpo_loss(model, x, y, self.beta, self.config.rpo_alpha)

    def with_reference(self, workers, x, targets) -> dict:
        return {"targets": targets, "ref_logps": self.reference.logps(workers, x, targets).sum(axis=-1)}

    def held_out_metrics(self, scores: list) -> dict:
        chosen, rejected = (np.concatenate(side) for side in zip(*(
            halves(self.beta * (s - np.array(y["ref_logps"]))) for s, y in scores)))
        return {"eval_rewards_chosen": float(chosen.mean()), "eval_rewards_rejected": float(rejected.mean()),
                "eval_reward_margin": float((chosen - rejected).mean()),
                "eval_reward_accuracy": float(np.mean(chosen > rejected))}
