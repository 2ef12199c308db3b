"""Completions sampled from a policy with mlx-lm's batched generation (`batch_generate`: the prompts'
KV caches right-padded into one batch, one token for every sequence a step), for GRPO's groups and
the held-out greedy accuracy.

Randomness: MLX's global random state, seeded before each call from (the run's seed, the worker, the
step), so that a worker's rollouts repeat whatever else this process trains, and in whichever layout
(one process, several, a cluster). The sampled ids are kept as they are (mlx-lm-lora re-encodes the
text, which need not give the same tokens); a completion that stopped gets its EOS back (mlx-lm drops
it), as TRL's mask keeps it: the loss learns to stop there.
"""

import mlx.core as mx
import numpy as np

from .base import evaluating

GREEDY = 0.0


def rollout_seed(seed: int, worker: int, step: int) -> int:
    """A seed of its own for each (run seed, worker, step)."""
    return int(np.random.SeedSequence([seed, worker, step]).generate_state(1)[0])


def sample(model, tokenizer, prompts: list, max_tokens: int, temperature: float = GREEDY, top_p: float = 1.0,
           seed: int = 0) -> tuple:
    """(each prompt's completion ids, whether it stopped on EOS): `prompts` are lists of ids; greedy at
    temperature 0. The model runs in eval mode (no dropout) with the parameters it holds."""
    from mlx_lm.generate import batch_generate
    from mlx_lm.sample_utils import make_sampler
    mx.random.seed(seed)
    with evaluating(model):
        out = batch_generate(model, tokenizer, prompts, max_tokens=max_tokens, return_token_ids=True,
                             sampler=make_sampler(temperature, top_p=top_p if top_p < 1 else 0.0),
                             prefill_batch_size=len(prompts), completion_batch_size=len(prompts))
    stopped = [len(ids) < max_tokens for ids in out.token_ids]  # mlx-lm leaves a stop's EOS out
    return out.token_ids, stopped


def with_eos(completions: list, stopped: list, eos: int) -> list:
    """The completions as the loss trains them: a stopped one ends with its EOS."""
    return [ids + [eos] if done else list(ids) for ids, done in zip(completions, stopped)]
