"""What a run optimizes (config `objective`, mlx-lm-lora's train_mode): sft, the data's next-token loss
(base.py); dpo and orpo on preference pairs (dpo.py, orpo.py, preference.py); grpo on prompts whose
completions are sampled and rewarded (grpo.py, rollouts.py, rewards.py). Each is one file and its
line in kinds.py's registry; every strategy trains them unchanged, exchanging what the run trains
(the adapters, under LoRA). A run hands its objective a `Context` (base.py) of what it may use.
docs/post-training.md says how to use them. Importing this package loads no MLX (kinds.py is
what the config and the launcher ask); an objective's class is imported when a run makes it."""

from importlib import import_module

from .kinds import DEFAULT, OBJECTIVES, Kind, kind


def objective_class(name: str):
    """The class of objective `name` (kinds.py names its module and class)."""
    k = kind(name)
    return getattr(import_module(f"{__name__}.{k.module}"), k.cls)


def make_objective(config, model, data, log=print):
    """The config's objective for `model` as the run trains it (adapters made: the reference is
    what trains at the start) and its data."""
    return objective_class(config.objective)(config, model, data, log)


__all__ = ["DEFAULT", "OBJECTIVES", "Kind", "kind", "objective_class", "make_objective"]
