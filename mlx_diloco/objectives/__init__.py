"""What a run optimizes (config `objective`, mlx-lm-lora's train_mode): sft, the data's next-token loss
(base.py); dpo and orpo on preference pairs (dpo.py, orpo.py, preference.py); grpo on prompts whose
completions are sampled and rewarded (grpo.py, rollouts.py, rewards.py). Each is one file; every
strategy trains them unchanged, exchanging what the run trains (the adapters, under LoRA).
docs/post-training.md says how to use them."""

from ..config import ConfigError
from .base import Objective
from .dpo import DPO
from .grpo import GRPO
from .orpo import ORPO

OBJECTIVES = {cls.name: cls for cls in (Objective, DPO, ORPO, GRPO)}


def check_model(config, spec):
    """Before any data is read: GRPO samples with mlx-lm's generation, which needs an mlx-lm model
    (its KV cache)."""
    if config.objective == "grpo" and spec.type in ("gpt", "cnn", "python"):
        # (a preset has no tokenizer of its own: suggested only beside one)
        preset = ", or a preset of an mlx-lm type such as llama-tiny" if config.tokenizer else ""
        raise ConfigError(f"objective grpo samples completions with mlx-lm's generation, which the {spec.type} "
                          f"model cannot run; pass an mlx-lm model folder (with its tokenizer; or a Hugging Face "
                          f"model ORG/NAME){preset}")


def make_objective(config, model, data, log=print) -> Objective:
    """The config's objective for `model` as the run trains it (adapters made: the reference is
    what trains at the start) and its data."""
    return OBJECTIVES[config.objective](config, model, data, log)
