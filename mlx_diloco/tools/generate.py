"""Sample text from a trained run."""

import json
from pathlib import Path

import mlx.core as mx

from ..config import ConfigError
from ..data.datasets import EMBEDDED, Tokenizer
from ..data.hf_tokenizer import hf_tokenizer
from .export import load_trained_model
from ..models import adapters

SHAKESPEARE_PROMPT = "ROMEO:"  # how a speech of the embedded corpus begins


def default_prompt(run_dir) -> str:
    """The prompt when none is given: a speaker's name for a run on the embedded Shakespeare; the
    first chat's last user message for a run on chat data; for any other corpus none (the model
    starts a text of its own)."""
    if run_config(run_dir).get("data") == EMBEDDED:
        return SHAKESPEARE_PROMPT
    users = [m.get("content", "") for m in first_record(run_dir).get("messages", []) if m.get("role") == "user"]
    return users[-1] if users else ""


def generate(run_dir, prompt: str, max_tokens: int = 200, temperature: float = 0.8, seed: int = 0):
    """Text pieces sampled from the run's global model after `prompt`. The model is loaded here,
    before the first piece is asked for: a run without a checkpoint fails before any output.
    A fine-tuning run's model is its base with its adapters, loaded as mlx-lm loads them; a run
    trained on chat data gets the prompt as a user's message, through the chat template."""
    if (adapters_dir := adapters.adapters_of(run_dir)).is_dir():
        model, tok = adapters.load_with_adapters(adapters_dir)
        context = run_config(run_dir).get("seq_len") or 2048
    else:
        model, spec, tokenizer_dir = load_trained_model(run_dir)
        if not spec.is_language_model or tokenizer_dir is None:
            raise ConfigError(f"run {run_dir} did not train a language model; generate needs one")
        tok, context = Tokenizer(tokenizer_dir), spec.context_length
        if trained_on_chat(run_dir):
            tok = hf_tokenizer(tokenizer_dir)
    ids = chat_prompt(tok, prompt) if trained_on_chat(run_dir) else tok.encode(prompt)
    return sample(model, tok, context, ids, max_tokens, temperature, seed)


def run_config(run_dir) -> dict:
    config = Path(run_dir) / "config.json"
    return json.loads(config.read_text()) if config.is_file() else {}


def trained_on_chat(run_dir) -> bool:
    """Whether the run trained on {"messages"} records (mlx-lm's chat format): its data's first
    record says so. False when the data is not here."""
    return "messages" in first_record(run_dir)


def first_record(run_dir) -> dict:
    """The first record of the run's JSONL data (a .jsonl file, or a folder's train.jsonl); {} when
    the data is not JSONL, or not here."""
    data = run_config(run_dir).get("data")
    path = Path(data) / "train.jsonl" if data and Path(data).is_dir() else Path(data or "")
    if path.suffix != ".jsonl" or not path.is_file():
        return {}
    with open(path) as f:
        first = next((line for line in f if line.strip()), "{}")
    try:
        record = json.loads(first)
    except json.JSONDecodeError:
        return {}
    return record if isinstance(record, dict) else {}


def chat_prompt(tok, prompt: str) -> list:
    """The token ids of `prompt` as a user's turn, ready for the assistant's reply."""
    if not tok.has_chat_template:
        raise ConfigError("the run trained on chat data but its tokenizer has no chat template; "
                          "add one to the tokenizer folder's tokenizer_config.json")
    # as mlx_lm.generate does: the template's text, whose special tokens it writes itself
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def sample(model, tok, context: int, prompt_ids: list, max_tokens: int, temperature: float, seed: int):
    """Yield `max_tokens` decoded tokens, each sampled from the model given all before it."""
    ids = list(prompt_ids) or [0]  # no prompt: start after token 0, the end of a text for our BPE
    mx.random.seed(seed)
    for _ in range(max_tokens):
        logits = model(mx.array([ids[-context:]]))[0, -1]
        if temperature > 0:
            next_id = mx.random.categorical(logits / temperature).item()
        else:
            next_id = mx.argmax(logits).item()
        ids.append(next_id)
        yield tok.decode([next_id])
