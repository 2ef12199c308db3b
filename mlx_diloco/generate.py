"""Sample text from a trained run."""

import json
from pathlib import Path

import mlx.core as mx

from .config import ConfigError
from .data.datasets import EMBEDDED, Tokenizer
from .export import load_trained_model

SHAKESPEARE_PROMPT = "ROMEO:"  # how a speech of the embedded corpus begins


def default_prompt(run_dir) -> str:
    """The prompt when none is given: a speaker's name for a run on the embedded Shakespeare;
    for any other corpus none (the model starts a text of its own)."""
    config = Path(run_dir) / "config.json"
    data = json.loads(config.read_text()).get("data") if config.is_file() else None
    return SHAKESPEARE_PROMPT if data == EMBEDDED else ""


def generate(run_dir, prompt: str, max_tokens: int = 200, temperature: float = 0.8, seed: int = 0):
    """Text pieces sampled from the run's global model after `prompt`. The model is loaded here,
    before the first piece is asked for: a run without a checkpoint fails before any output."""
    model, spec, tokenizer_dir = load_trained_model(run_dir)
    if not spec.is_language_model or tokenizer_dir is None:
        raise ConfigError(f"run {run_dir} did not train a language model; generate needs one")
    return sample(model, Tokenizer(tokenizer_dir), spec.context_length, prompt, max_tokens, temperature, seed)


def sample(model, tok, context: int, prompt: str, max_tokens: int, temperature: float, seed: int):
    """Yield `max_tokens` decoded tokens, each sampled from the model given all before it."""
    ids = tok.encode(prompt) or [0]  # no prompt: start after token 0, the end of a text for our BPE
    mx.random.seed(seed)
    for _ in range(max_tokens):
        logits = model(mx.array([ids[-context:]]))[0, -1]
        if temperature > 0:
            next_id = mx.random.categorical(logits / temperature).item()
        else:
            next_id = mx.argmax(logits).item()
        ids.append(next_id)
        yield tok.decode([next_id])
