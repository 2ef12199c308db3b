"""GRPO (Shao et al. 2024, arXiv 2402.03300), with Dr. GRPO's (arXiv 2503.20783) and DAPO's options,
as TRL's GRPOTrainer computes it (one policy update per batch of rollouts, TRL's num_iterations 1).

Before each inner step, every worker samples --group-size completions of each of its B prompts from
its own current policy (rollouts.py), scores them (rewards.py) and takes its group-relative advantages:

    A_i = (r_i - mean of the group's r) / (std of the group's r, Bessel-corrected, + 1e-4)
          (--scale-rewards batch: the std of the worker's batch; none: no division)

With DiLoCo each worker stays on-policy within its round: its rollouts come from the policy it
trains, and groups never straddle workers (no exchange). The loss, per completion token t of
completion i, the log-probabilities lp of the logits divided by --temperature:

    ratio = exp(lp - stop_gradient(lp))                              (1: on-policy; its gradient lp's)
    l     = -min(ratio A_i, clip(ratio, 1 - epsilon, 1 + epsilon-high) A_i)
            + beta (exp(ref - lp) - (ref - lp) - 1)                  (k3, the KL to the reference; beta 0: none)
    grpo:    mean over completions of (sum over its tokens of l) / its token count
    bnpo, dapo: (sum over the batch's completion tokens of l) / their count
    dr_grpo: (sum over the batch's completion tokens of l) / (completions x max-completion-length)

The prompt and the padding are masked; a completion's tokens run to its EOS, included.

Metrics, every evaluation (since the one before, each worker's and all of theirs): reward mean and
std (the std within groups, their mean), the share of groups whose rewards are all equal (no
advantage: `frac_reward_zero_std`), completion length and the share cut at max-completion-length,
the KL to the reference (each worker's policy, on its last rollouts); the tokens generated and
trained, and the seconds generating (rollouts, rewards, reference pass) and training, per worker.
Held out, the global model's greedy completions of the held-out prompts: `eval_accuracy` (exact
answers) and `eval_reward`; the eval loss is the answers' NLL (each prompt's answer as a completion).
"""

import time
import warnings
from dataclasses import asdict, dataclass

import mlx.core as mx
import numpy as np

from ..data.jsonl import IGNORE, padded_arrays
from ..exchange.worker_axis import replica
from ..options import ConfigError
from .base import Context, Objective, Reference, Tally, completion_logps, members_of, with_params
from .rewards import RewardError, Rewards, exact_answer
from .rollouts import GREEDY, rollout_seed, sample, with_eos

HELD_OUT_BATCH = 256  # held-out prompts generated together
# A collapse (issue 46: at lr 2e-3 held-out accuracy fell 52.6 -> 8.4 -> 1.8% in 30 steps, while a run
# that learns dips by at most ~10 points on the way up): accuracy or reward below this share of their best.
COLLAPSED_SHARE = 0.5
STATS = ("reward", "reward_std", "groups", "zero_std_groups", "completions", "completion_tokens", "clipped",
         "tokens_trained", "generate_s", "train_s")


def grpo_loss(model, x, y, beta: float, epsilon: float, epsilon_high: float, loss_type: str, temperature: float,
              max_completion_length: int):
    """x: (rows, T) prompt and completion; y: {"targets": (rows, T), IGNORE off the completion,
    "advantages": (rows,), and with beta, "ref_logps": (rows, T)}. A held-out batch (no advantages)
    scores the answers: their token-mean NLL."""
    if "advantages" not in y:
        logps, scored = completion_logps(model, x, y["targets"])
        return -logps.sum() / mx.maximum(scored.sum(), 1)
    logps, scored = completion_logps(model, x, y["targets"], temperature)
    ratio = mx.exp(logps - mx.stop_gradient(logps))
    advantages = y["advantages"][:, None]
    per_token = -mx.minimum(ratio * advantages, mx.clip(ratio, 1 - epsilon, 1 + epsilon_high) * advantages)
    if beta:
        delta = y["ref_logps"] - logps
        per_token = per_token + beta * (mx.exp(delta) - delta - 1)
    per_token = per_token * scored
    if loss_type == "grpo":
        return (per_token.sum(axis=-1) / mx.maximum(scored.sum(axis=-1), 1)).mean()
    if loss_type == "dr_grpo":
        return per_token.sum() / (per_token.shape[0] * max_completion_length)
    return per_token.sum() / mx.maximum(scored.sum(), 1)  # bnpo, dapo


@dataclass
class Health:
    """What a GRPO run has reached (its best held-out accuracy and training reward, the KL then), to
    tell a collapse from a dip: `collapse(row)` is '' or one line of why."""
    best_accuracy: float = None
    best_reward: float = None
    kl_at_best: float = None

    def collapse(self, row: dict) -> str:
        accuracy, reward, kl = row.get("eval_accuracy"), row.get("reward"), row.get("kl")
        signs = []
        if accuracy is not None and self.best_accuracy and accuracy < COLLAPSED_SHARE * self.best_accuracy:
            signs.append(f"held-out accuracy {accuracy:.1%} (best {self.best_accuracy:.1%})")
        if reward is not None and self.best_reward and reward < COLLAPSED_SHARE * self.best_reward:
            signs.append(f"reward {reward:.3g} (best {self.best_reward:.3g})")
        if signs and kl is not None and self.kl_at_best is not None and kl > self.kl_at_best:
            signs.append(f"KL to the reference {kl:.3g} (was {self.kl_at_best:.3g})")
        if accuracy is not None and (self.best_accuracy is None or accuracy > self.best_accuracy):
            self.best_accuracy = accuracy
        if reward is not None and (self.best_reward is None or reward > self.best_reward):
            self.best_reward, self.kl_at_best = reward, kl
        return ("GRPO is collapsing: " + ", ".join(signs) + "; lower --lr, or raise --beta to hold the policy "
                "near its start") if signs else ""


def group_advantages(rewards: np.ndarray, group_size: int, scaling: str) -> tuple:
    """(advantages, each group's reward std) of rewards (rows,) in groups of `group_size` rows (TRL's:
    NaN rewards, a completion no function scored, are left out, and get advantage 0)."""
    groups = rewards.reshape(-1, group_size)
    with warnings.catch_warnings():  # a group of NaNs: its mean and std are NaN, its advantages 0
        warnings.simplefilter("ignore", RuntimeWarning)
        std = np.nanstd(groups, axis=1, ddof=1)
        advantages = groups - np.nanmean(groups, axis=1, keepdims=True)
        if scaling == "group":
            advantages = advantages / (std[:, None] + 1e-4)
        elif scaling == "batch":
            advantages = advantages / (np.nanstd(rewards, ddof=1) + 1e-4)
    return np.nan_to_num(advantages.reshape(-1), nan=0.0), std


class GRPO(Objective):
    name = "grpo"
    summary_keys = ("tokens_generated", "tokens_trained", "generate_s", "train_s", "eval_accuracy")

    def __init__(self, config, model, data, log=print):
        super().__init__(config, model, data, log)
        c = config
        self.beta, self.scaling, self.rewards = c.objective_beta(), c.reward_scaling(), Rewards(c)
        self.reference = Reference(model)
        self.width = data.train.width + c.max_completion_length - 1  # every batch's: the step compiles once
        self.tally, self.total = None, None  # since the last evaluation; since the start
        self.last, self.timed = None, None  # the last rollouts; the last step, until its time is counted
        self.health, self.said_collapse = Health(), False

    @classmethod
    def check_model(cls, config, spec):
        """GRPO samples with mlx-lm's generation, which needs an mlx-lm model (its KV cache)."""
        if spec.type in ("gpt", "cnn", "python"):
            # (a preset has no tokenizer of its own: suggested only beside one)
            preset = ", or a preset of an mlx-lm type such as llama-tiny" if config.tokenizer else ""
            raise ConfigError(f"objective grpo samples completions with mlx-lm's generation, which the {spec.type} "
                              f"model cannot run; pass an mlx-lm model folder (with its tokenizer; or a Hugging Face "
                              f"model ORG/NAME){preset}")

    @classmethod
    def notes(cls, config) -> list:
        if config.grpo_loss_type == "dr_grpo" and not config.scale_rewards:
            return ["grpo-loss-type dr_grpo: advantages not divided by the group's reward std (scale-rewards "
                    "none), as Dr. GRPO's paper has it; pass --scale-rewards group to keep it"]
        return []

    def loss(self, model, x, y):
        c = self.config
        return grpo_loss(model, x, y, self.beta, c.epsilon, c.epsilon_high or c.epsilon, c.grpo_loss_type,
                         c.temperature, c.max_completion_length)

    def eval_batches(self, workers, batches):
        """The held-out prompts with their answers as completions (the loss scores the answers' NLL)."""
        return [(x, {"targets": y}) for x, y in batches]

    def batch(self, context: Context, x, y, tick):
        """Each local worker's rollouts of its prompts (y: their indices), scored: the loss's batch."""
        start, n = time.perf_counter(), x.shape[0]
        if self.tally is None:
            self.tally, self.total = Tally(n, STATS), Tally(n, STATS)
        self.count_training()
        members = members_of(tick, n)
        rows = [self.rollouts(context.workers, i, context.slots[i], np.array(y[i]), tick.step) for i in range(n)]
        inputs, targets, advantages = (mx.array(np.stack([row[k] for row in rows])) for k in range(3))
        batch = {"targets": targets, "advantages": advantages.astype(mx.float32)}
        if self.beta:
            batch["ref_logps"] = self.reference.logps(context.workers, inputs, targets, self.config.temperature)
        self.last = (inputs, targets)
        stats = {k: [row[3][k] for row in rows] for k in rows[0][3]}
        stats["tokens_trained"] = np.array((targets != IGNORE).sum(axis=(1, 2)))
        stats["generate_s"] = (time.perf_counter() - start) / n
        for tally in (self.tally, self.total):
            tally.add(members, **stats)
        self.timed = (tick, members, stats["generate_s"])
        return inputs, batch

    def count_training(self):
        """The last step's training seconds per worker: its inner step's (which the run measures after
        `batch`, in the tick) less the rollouts'."""
        if self.timed:
            tick, members, generating = self.timed
            for tally in (self.tally, self.total):
                tally.add(members, train_s=tick.seconds / len(members) - generating)
            self.timed = None

    def rollouts(self, workers, i: int, slot: int, indices: np.ndarray, step: int) -> tuple:
        """Worker i's (inputs, targets, advantages, stats) of its prompts' groups, sampled from its policy."""
        c, train, tokenizer = self.config, self.data.train, self.data.tokenizer
        prompts = [train.ids[j] for j in indices for _ in range(c.group_size)]
        completions, stopped = with_params(workers, replica(workers.params, i), lambda model: sample(
            model, tokenizer, prompts, c.max_completion_length, c.temperature, c.top_p,
            seed=rollout_seed(c.seed, slot, step)))
        texts = [tokenizer.decode(ids) for ids in completions]
        given = [train.prompts[j] for j in indices for _ in range(c.group_size)]
        answers = [train.answers[j] for j in indices for _ in range(c.group_size)]
        try:
            rewards = self.rewards(given, texts, answers, completions)
        except RewardError as e:
            raise RewardError(f"worker {slot}: {e}") from None
        advantages, std = group_advantages(rewards, c.group_size, self.scaling)
        trained = with_eos(completions, stopped, tokenizer.eos_token_id)
        inputs, targets = padded_arrays([(p + t, len(p)) for p, t in zip(prompts, trained)], self.width)
        stats = {"reward": np.nansum(rewards), "reward_std": np.nansum(std), "groups": len(std),
                 "zero_std_groups": np.sum(np.isclose(np.nan_to_num(std), 0)), "completions": len(texts),
                 "completion_tokens": sum(len(ids) for ids in completions), "clipped": stopped.count(False)}
        return inputs, targets, advantages, stats

    def report(self, context: Context) -> dict:
        row = self.rollout_metrics(context)
        if context.reporter:
            row.update(self.held_out(context))
            row["collapse"] = self.health.collapse(row)
            if row["collapse"] and not self.said_collapse:
                self.log(row["collapse"])  # once; every row after says it too, and the dashboard shows it
            self.said_collapse = self.said_collapse or bool(row["collapse"])
        return row

    def rollout_metrics(self, context: Context) -> dict:
        """The rollouts' metrics since the last evaluation (none before the first step)."""
        if self.tally is None:
            return {}
        self.count_training()
        kl = self.kl_to_reference(context)
        recent, total = self.tally.gather(context.comm), self.total.gather(context.comm)
        kls = context.comm.gather_metric(mx.array(kl))
        self.tally.clear()
        completions = max(sum(recent["completions"]), 1)
        per_worker = [r / max(n, 1) for r, n in zip(recent["reward"], recent["completions"])]
        mean = sum(recent["reward"]) / completions
        row = {"reward": mean, "reward_workers": per_worker,
               "reward_std": sum(recent["reward_std"]) / max(sum(recent["groups"]), 1),
               "reward_std_workers": [s / max(g, 1) for s, g in zip(recent["reward_std"], recent["groups"])],
               "frac_reward_zero_std": sum(recent["zero_std_groups"]) / max(sum(recent["groups"]), 1),
               "completion_length": sum(recent["completion_tokens"]) / completions,
               "completions_clipped": sum(recent["clipped"]) / completions,
               "kl": float(np.nanmean(kls)), "kl_workers": kls,
               "tokens_generated": int(sum(total["completion_tokens"])), "tokens_trained": int(sum(total["tokens_trained"])),
               "generate_s": float(np.mean(total["generate_s"])), "train_s": float(np.mean(total["train_s"]))}
        return row

    def state(self) -> dict:
        return {"total": self.total.state(), "health": asdict(self.health)} if self.total else {}

    def load_state(self, state: dict):
        if state:  # the totals since the start; the next evaluation's are from the resumed step on
            self.total = Tally.from_state(state["total"])
            self.tally = Tally(len(self.total.sums), STATS)
            self.health = Health(**state.get("health", {}))

    def kl_to_reference(self, context: Context) -> list:
        """Each local worker's KL to the reference (k3, the mean over its completion tokens) on its
        last rollouts, under its policy now (NaN before any: a run resumed at its end)."""
        if self.last is None:
            return [float("nan")] * context.comm.n_local
        inputs, targets = self.last
        ref = self.reference.logps(context.workers, inputs, targets, self.config.temperature)
        out = []
        for i in range(inputs.shape[0]):
            logps, scored = with_params(context.workers, replica(context.workers.params, i), lambda model: completion_logps(
                model, inputs[i], targets[i], self.config.temperature))
            delta = ref[i] - logps
            out.append(float(((mx.exp(delta) - delta - 1) * scored).sum() / mx.maximum(scored.sum(), 1)))
        return out

    def held_out(self, context: Context) -> dict:
        """The global model's greedy completions of the held-out prompts: their exact-answer accuracy
        and mean reward."""
        c, held, tokenizer = self.config, self.data.held_out, self.data.tokenizer
        params, texts, ids = context.global_params(), [], []
        for start in range(0, len(held), HELD_OUT_BATCH):
            prompts = held.ids[start:start + HELD_OUT_BATCH]
            completions, _ = with_params(context.workers, params, lambda model: sample(
                model, tokenizer, prompts, c.max_completion_length, GREEDY))
            ids += completions
            texts += [tokenizer.decode(x) for x in completions]
        correct = exact_answer(held.prompts, texts, held.answers)
        return {"eval_accuracy": float(np.mean(correct)),
                "eval_reward": float(np.nanmean(self.rewards(held.prompts, texts, held.answers, ids)))}
