"""The post-training losses (issue 38) against a float64 numpy reference written from the papers and
TRL's formulas: DPO (sigmoid), ORPO and GRPO (its loss types, the KL term, temperature), their
values and their gradients (central differences of the reference), on tiny tensors whose prompt and
padding positions hold garbage logits that must change nothing; and GRPO's group advantages."""

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_diloco.data.jsonl import IGNORE
from mlx_diloco.objectives.dpo import dpo_loss
from mlx_diloco.objectives.grpo import grpo_loss, group_advantages
from mlx_diloco.objectives.orpo import orpo_loss

V, T = 7, 6
RNG = np.random.default_rng(0)


class Logits(nn.Module):
    """A 'model' whose output is its parameter: the loss's gradient is the gradient in the logits."""

    def __init__(self, logits):
        super().__init__()
        self.logits = mx.array(logits.astype(np.float32))

    def __call__(self, x):
        return self.logits


def targets(rows: int, prompt: list, length: list) -> np.ndarray:
    """Random target ids, IGNORE before each row's prompt length (the prompt's targets) and from its
    length on (padding)."""
    t = RNG.integers(0, V, (rows, T))
    pos = np.arange(T)
    keep = (pos >= np.array(prompt)[:, None]) & (pos < np.array(length)[:, None])
    return np.where(keep, t, IGNORE)


def np_logps(z, y, tau=1.0):
    """float64: log_softmax(z / tau) at each target, 0 where IGNORE; and the mask."""
    z = z / tau
    lsm = z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) - z.max(-1, keepdims=True)
    mask = y != IGNORE
    lp = np.take_along_axis(lsm, np.where(mask, y, 0)[..., None], -1)[..., 0]
    return lp * mask, mask


def numeric_grad(f, z, eps=1e-6):
    g = np.zeros_like(z)
    for i in np.ndindex(z.shape):
        d = np.zeros_like(z)
        d[i] = eps
        g[i] = (f(z + d) - f(z - d)) / (2 * eps)
    return g


def mlx_value_and_grad(loss, z, y):
    model = Logits(z)
    value, grads = nn.value_and_grad(model, lambda m: loss(m, mx.zeros((z.shape[0], T), mx.int32), y))(model)
    return float(value), np.array(grads["logits"])


def log_sigmoid(x):
    return -np.logaddexp(0, -x)


def check(loss, reference, z, y, masked):
    """The MLX loss and gradient equal the float64 reference's; masked positions have no gradient,
    and garbage logits there change nothing."""
    value, grad = mlx_value_and_grad(loss, z, y)
    assert value == pytest.approx(reference(z), rel=1e-5, abs=1e-6)
    np.testing.assert_allclose(grad, numeric_grad(reference, z), rtol=1e-3, atol=2e-6)
    assert not np.any(grad[masked])
    garbage = z.copy()
    garbage[masked] = RNG.normal(0, 50, garbage[masked].shape)
    value2, grad2 = mlx_value_and_grad(loss, garbage, y)
    assert value2 == pytest.approx(value, rel=1e-6)
    np.testing.assert_allclose(grad2[~masked], grad[~masked], rtol=1e-5, atol=1e-8)


def pair_batch(B=3):
    """2B rows (B chosen, then B rejected) of different prompt and completion lengths."""
    prompt = [1, 2, 1, 1, 2, 1]
    length = [5, 6, 3, 4, 4, 6]
    return RNG.normal(0, 1, (2 * B, T, V)), targets(2 * B, prompt, length)


@pytest.mark.parametrize("beta, rpo_alpha", [(0.1, 0.0), (0.5, 0.0), (0.1, 1.0), (0.5, 0.3)])
def test_dpo_loss_and_gradient_match_trl(beta, rpo_alpha):
    z, y = pair_batch()
    ref = RNG.normal(-8, 2, len(z))  # the reference's summed log-probabilities

    def reference(z):
        lp, mask = np_logps(z, y)
        margin = lp.sum(-1) - ref
        half = len(z) // 2
        delta = margin[:half] - margin[half:]
        nll = -lp[:half].sum() / mask[:half].sum()  # RPO: the chosen completions' token-mean NLL (TRL's rpo_alpha)
        return np.mean(-log_sigmoid(beta * delta)) + rpo_alpha * nll
    loss = lambda m, x, t: dpo_loss(m, x, {"targets": t["targets"], "ref_logps": t["ref_logps"]}, beta,  # noqa: E731
                                    rpo_alpha)
    check(loss, reference, z, {"targets": mx.array(y), "ref_logps": mx.array(ref.astype(np.float32))}, y == IGNORE)


@pytest.mark.parametrize("beta", [0.1, 1.0])
def test_orpo_loss_and_gradient_match_trl(beta):
    z, y = pair_batch()

    def reference(z):
        lp, mask = np_logps(z, y)
        mean = lp.sum(-1) / mask.sum(-1)
        half = len(z) // 2
        c, r = mean[:half], mean[half:]
        log_odds = (c - r) - (np.log1p(-np.exp(c)) - np.log1p(-np.exp(r)))
        nll = -lp[:half].sum() / mask[:half].sum()
        return nll - beta * np.mean(log_sigmoid(log_odds))
    check(lambda m, x, t: orpo_loss(m, x, t, beta), reference, z, {"targets": mx.array(y)}, y == IGNORE)


def test_orpo_log1mexp_is_exact_on_both_sides_of_minus_ln2():
    from mlx_diloco.objectives.orpo import log1mexp
    x = np.array([-1e-4, -0.1, -0.69, -0.7, -3.0, -30.0])
    np.testing.assert_allclose(np.array(log1mexp(mx.array(x.astype(np.float32)))), np.log(-np.expm1(x)), rtol=1e-5, atol=1e-9)
    g = np.array(mx.grad(lambda v: log1mexp(v).sum())(mx.array(x.astype(np.float32))))
    assert np.all(np.isfinite(g))


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize("beta, tau", [(0.0, 1.0), (0.04, 0.7)])
def test_grpo_loss_and_gradient_match_trl(loss_type, beta, tau):
    rows, max_completion = 4, 5
    prompt, length = [2, 2, 3, 1], [6, 4, 5, 3]  # completions of 4, 2, 2 and 2 tokens, then padding
    z, y = RNG.normal(0, 1, (rows, T, V)), targets(rows, prompt, length)
    advantages = np.array([1.3, -0.4, 0.0, -0.9])
    ref = np.where(y != IGNORE, RNG.normal(-2, 0.5, (rows, T)), 0.0)
    old, _ = np_logps(z, y, tau)  # the policy that sampled: the same one (TRL's num_iterations 1)

    def reference(zz):
        lp, mask = np_logps(zz, y, tau)
        ratio = np.exp(lp - old)
        clipped = np.clip(ratio, 0.8, 1.2)
        per_token = -np.minimum(ratio * advantages[:, None], clipped * advantages[:, None])
        per_token = per_token + beta * (np.exp(ref - lp) - (ref - lp) - 1)
        per_token = per_token * mask
        if loss_type == "grpo":
            return np.mean(per_token.sum(-1) / mask.sum(-1))
        if loss_type == "dr_grpo":
            return per_token.sum() / (rows * max_completion)
        return per_token.sum() / mask.sum()
    batch = {"targets": mx.array(y), "advantages": mx.array(advantages.astype(np.float32)),
             "ref_logps": mx.array(ref.astype(np.float32))}
    loss = lambda m, x, t: grpo_loss(m, x, t, beta, 0.2, 0.2, loss_type, tau, max_completion)  # noqa: E731
    check(loss, reference, z, batch, y == IGNORE)


def test_grpo_scores_a_held_out_batch_by_its_answers_nll():
    z, y = RNG.normal(0, 1, (3, T, V)), targets(3, [1, 2, 3], [4, 6, 5])
    lp, mask = np_logps(z, y)
    value, _ = mlx_value_and_grad(lambda m, x, t: grpo_loss(m, x, t, 0.0, 0.2, 0.2, "grpo", 0.5, 4), z,
                                  {"targets": mx.array(y)})
    assert value == pytest.approx(-lp.sum() / mask.sum(), rel=1e-5)  # at temperature 1, whatever the sampling's


def test_group_advantages_as_trl_computes_them():
    rewards = np.array([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0, np.nan, 1.0, 3.0, np.nan])
    advantages, std = group_advantages(rewards, 4, "group")
    g = rewards[:4]
    np.testing.assert_allclose(advantages[:4], (g - g.mean()) / (np.std(g, ddof=1) + 1e-4))
    np.testing.assert_allclose(advantages[4:8], 0.0)  # all equal: no advantage
    assert std[1] == 0
    scored = np.array([1.0, 3.0])  # NaN (no function scored it): left out, and advantage 0
    np.testing.assert_allclose(advantages[8:], [0.0, *((scored - 2.0) / (np.std(scored, ddof=1) + 1e-4)), 0.0])
    none, _ = group_advantages(rewards, 4, "none")
    np.testing.assert_allclose(none[:4], g - g.mean())
    batch, _ = group_advantages(rewards, 4, "batch")
    np.testing.assert_allclose(batch[:4], (g - g.mean()) / (np.nanstd(rewards, ddof=1) + 1e-4))
    assert math.isclose(float(np.nansum(advantages)), 0.0, abs_tol=1e-9)


def test_dr_grpo_drops_the_std_unless_scale_rewards_keeps_it(tmp_path):
    """Dr. GRPO's two changes (the constant normalizer, no std), both by one option, said when run."""
    from conftest import addition_task
    from mlx_diloco.config import TrainConfig
    from mlx_diloco.training.resolve import resolve
    task = addition_task(tmp_path)
    base = dict(model=str(task / "model"), data=str(task / "grpo"), objective="grpo", fine_tune_type="lora",
                seq_len=16, max_completion_length=6)
    dr = TrainConfig.from_dict({**base, "grpo_loss_type": "dr_grpo"})
    assert dr.reward_scaling() == "none"
    said = "advantages not divided by the group's reward std"
    assert any(said in note for note in resolve(dr).notes)
    kept = TrainConfig.from_dict({**base, "grpo_loss_type": "dr_grpo", "scale_rewards": "group"})
    assert kept.reward_scaling() == "group" and not any(said in note for note in resolve(kept).notes)
    assert TrainConfig.from_dict(base).reward_scaling() == "group"
