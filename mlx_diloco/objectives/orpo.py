"""ORPO (Hong et al. 2024, arXiv 2403.07691), no reference model, as TRL's ORPOTrainer computes it:

    l(b)     = mean over the completion's tokens of log p(token)        (prompt and padding masked)
    log_odds = (l_chosen - l_rejected) - (log(1 - e^l_chosen) - log(1 - e^l_rejected))
    loss     = NLL(chosen) - lambda * mean over pairs of log sigmoid(log_odds)   (lambda: --beta, 0.1)

NLL(chosen) is the token mean of the chosen completions' cross-entropy over the batch: the paper's
L_SFT on the chosen response. TRL takes it over the chosen sequences' prompt tokens too; here the
prompt is masked, as in every objective's loss.
"""

import math

import mlx.core as mx
import mlx.nn as nn

from .base import completion_logps
from .preference import Preference, halves

LN2 = math.log(2.0)


def log1mexp(x):
    """log(1 - e^x) for x < 0, each side of -ln 2 by the form that is exact there (Maechler 2012;
    TRL's log1mexp), each form fed only the inputs it is used for (no inf in the other's gradient)."""
    near_zero = mx.log(-mx.expm1(mx.maximum(x, -LN2)))
    far = mx.log1p(-mx.exp(mx.minimum(x, -LN2)))
    return mx.where(x > -LN2, near_zero, far)


def orpo_loss(model, x, y, beta: float):
    """x: (2B, T), the B chosen sequences then their B rejected ones; y: {"targets": (2B, T) with
    IGNORE off the completions}."""
    logps, scored = completion_logps(model, x, y["targets"])
    mean_logps = logps.sum(axis=-1) / mx.maximum(scored.sum(axis=-1), 1)
    chosen, rejected = halves(mean_logps)
    log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
    chosen_logps, chosen_scored = halves(logps)[0], halves(scored)[0]
    nll = -chosen_logps.sum() / mx.maximum(chosen_scored.sum(), 1)
    return nll - beta * nn.log_sigmoid(log_odds).mean()


class ORPO(Preference):
    name = "orpo"

    def loss(self, model, x, y):
        return orpo_loss(model, x, y, self.beta)
