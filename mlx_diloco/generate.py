"""Sample text from a trained run."""

import mlx.core as mx

from .config import ConfigError
from .data.datasets import Tokenizer
from .export import load_trained_model


def generate(run_dir, prompt: str, max_tokens: int = 200, temperature: float = 0.8, seed: int = 0):
    """Yield text pieces sampled from the run's global model."""
    model, spec, tokenizer_dir = load_trained_model(run_dir)
    if not spec.is_language_model or tokenizer_dir is None:
        raise ConfigError(f"run {run_dir} did not train a language model; generate needs one")
    tok = Tokenizer(tokenizer_dir)
    ids = tok.encode(prompt) or [0]
    mx.random.seed(seed)
    context = spec.context_length
    for _ in range(max_tokens):
        logits = model(mx.array([ids[-context:]]))[0, -1]
        if temperature > 0:
            next_id = mx.random.categorical(logits / temperature).item()
        else:
            next_id = mx.argmax(logits).item()
        ids.append(next_id)
        yield tok.decode([next_id])
