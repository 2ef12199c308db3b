"""Model presets and how to build a model from one.

A preset is a JSON file in models/ (installed as mlx_diloco.presets) whose "type" picks the
architecture: "gpt" (ours, nanoGPT-style), "llama" (mlx-lm's Llama, randomly initialised),
"cnn" (ours). A folder holding an mlx-lm model (config.json + *.safetensors) is loaded with its
weights, for fine-tuning.
"""

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from .config import ConfigError


@dataclass
class ModelSpec:
    name: str
    params: dict          # the preset's contents, "type" included
    path: Path = None     # set for an mlx-lm model folder

    @property
    def type(self):
        return self.params["type"]

    @property
    def is_language_model(self):
        return self.type != "cnn"

    @property
    def vmappable(self):
        # MLX 0.32 cannot vmap the gradient of conv2d ("not implemented for AsStrided")
        return self.type != "cnn"

    @property
    def context_length(self):
        p = self.params
        return p.get("context_length") or p.get("max_position_embeddings") or 2048

    @property
    def vocab_size(self):
        return self.params.get("vocab_size")


def preset_names():
    return sorted(p.name[:-5] for p in resources.files("mlx_diloco.presets").iterdir() if p.name.endswith(".json"))


def load_spec(name: str) -> ModelSpec:
    """Resolve a preset name, a preset JSON path or an mlx-lm model folder."""
    path = Path(name)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ConfigError(f"model folder {path} has no config.json; pass an mlx-lm model folder or a preset name")
        params = json.loads((path / "config.json").read_text())
        return ModelSpec(path.name, {**params, "type": "mlx-lm"}, path=path)
    if path.suffix == ".json" and path.is_file():
        return ModelSpec(path.stem, json.loads(path.read_text()))
    preset = resources.files("mlx_diloco.presets") / f"{name}.json"
    if not preset.is_file():
        raise ConfigError(f"unknown model preset '{name}'; choose one of {', '.join(preset_names())}, "
                          "or pass a preset .json file or an mlx-lm model folder")
    return ModelSpec(name, json.loads(preset.read_text()))


def build_model(spec: ModelSpec, seed: int = 0) -> nn.Module:
    """Build the model, randomly initialised from `seed` (or with its weights, for a model folder).
    The vocabulary size is the preset's; the BPE tokenizer is trained to that size."""
    mx.random.seed(seed)
    params = {k: v for k, v in spec.params.items() if k != "type"}
    if spec.type == "gpt":
        from .gpt import GPT, GPTArgs
        model = GPT(GPTArgs.from_dict(params))
    elif spec.type == "cnn":
        from .cnn import CNN, CNNArgs
        model = CNN(CNNArgs.from_dict(params))
    elif spec.type == "llama":
        from mlx_lm.models import llama
        model = llama.Model(llama.ModelArgs.from_dict({**params, "model_type": "llama"}))
    elif spec.type == "mlx-lm":
        from mlx_lm.utils import load_model
        model, _ = load_model(spec.path)
    else:
        raise ConfigError(f"model preset '{spec.name}' has unknown type '{spec.type}'; use gpt, llama or cnn")
    mx.eval(model.parameters())
    return model


def count_parameters(model: nn.Module) -> int:
    from mlx.utils import tree_flatten
    return sum(p.size for _, p in tree_flatten(model.parameters()))
