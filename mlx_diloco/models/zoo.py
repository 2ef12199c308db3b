"""Model presets and how to build a model from one.

A preset is a JSON file in models/ (installed as mlx_diloco.presets) whose "type" picks the
architecture: "gpt" (ours, nanoGPT-style), "cnn" (ours), or any mlx-lm `model_type` ("llama",
"qwen3", ...: that mlx-lm architecture, randomly initialised, the other keys its ModelArgs).
A folder holding an mlx-lm model (config.json + *.safetensors) is loaded with its weights, for
fine-tuning. `package.module:function` names a builder of your own: called with no arguments, it
returns an mlx.nn.Module; a `preset` dict on the function gives what the run needs to know
(`vocab_size` and `context_length` for a language model, `language_model: False` for images).
On a cluster the module must be installed on every machine, whose agents run such names only when
started with --allow-code (cluster/allowed.py).
"""

import contextlib
import inspect
import io
import json
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..hub import cached_folder, download, is_hub_name
from ..options import ConfigError, did_you_mean, read_json


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
        return self.params.get("language_model", self.type != "cnn")

    @property
    def context_length(self):
        p = self.params
        return p.get("context_length") or p.get("max_position_embeddings") or 2048

    @property
    def vocab_size(self):
        return self.params.get("vocab_size")

    @property
    def num_blocks(self) -> int:
        """Transformer blocks (what Streaming DiLoCo deals into fragments); 0 for the CNN."""
        return self.params.get("n_layer") or self.params.get("num_hidden_layers") or 0


def preset_names():
    return sorted(p.name[:-5] for p in resources.files("mlx_diloco.presets").iterdir() if p.name.endswith(".json"))


def load_spec(name: str) -> ModelSpec:
    """Resolve a preset name, a preset JSON path, an mlx-lm model folder or a Hugging Face hub name
    (ORG/NAME: its folder in this machine's cache, which mlx-lm downloads it into if missing)."""
    path = Path(name)
    if ":" in name and not path.exists():
        return ModelSpec(name, {"type": "python", "builder": name, **getattr(import_builder(name), "preset", {})})
    if is_hub_name(name):
        path = cached_folder(name) or download(name)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ConfigError(f"model folder {path} has no config.json; pass an mlx-lm model folder or a preset name")
        params = json.loads((path / "config.json").read_text())
        return ModelSpec(Path(name).name, {**params, "type": "mlx-lm"}, path=path)  # a hub name: NAME of ORG/NAME
    if path.suffix == ".json" and path.is_file():
        return checked_spec(ModelSpec(path.stem, read_preset(path)))
    preset = resources.files("mlx_diloco.presets") / f"{name}.json"
    if not preset.is_file():
        raise ConfigError(f"unknown model preset '{name}'; choose one of {', '.join(preset_names())}, "
                          "or pass a preset .json file, an mlx-lm model folder or a Hugging Face model (ORG/NAME)")
    return checked_spec(ModelSpec(name, read_preset(preset)))


def read_preset(path) -> dict:
    params = read_json(path, "a model preset", "pass a preset's JSON file, a preset name or an mlx-lm model folder")
    if not isinstance(params, dict) or not isinstance(params.get("type"), str):
        raise ConfigError(f"model preset {path} must be a JSON object with a \"type\" "
                          "(gpt, cnn, or an mlx-lm model_type such as llama)")
    return params


def checked_spec(spec: ModelSpec) -> ModelSpec:
    """Unknown architectures, misspelled mlx-lm options and a malformed quantization are found
    before any data is read."""
    if spec.type not in OWN_TYPES:
        mlx_lm_classes(spec)
        quantization = spec.params.get("quantization")
        if quantization is not None and not (isinstance(quantization, dict) and {"group_size", "bits"} <= set(quantization)
                                             <= {"group_size", "bits", "mode"}):
            raise ConfigError(f"model preset '{spec.name}': quantization must be as mlx-lm's config.json has it, "
                              f"e.g. {{\"group_size\": 64, \"bits\": 4}} (and optionally \"mode\"); got {json.dumps(quantization)}")
    return spec


# A transformer block's path, parameter or module: `h.N` (our GPT) or `layers.N` (mlx-lm); N in group 1.
BLOCK = re.compile(r"(?:^|\.)(?:h|layers)\.(\d+)(?=\.|$)")

OWN_TYPES = ("gpt", "cnn", "mlx-lm", "python")  # a model folder, a builder; any other type: an mlx-lm architecture


def import_builder(target: str, what: str = "model builder"):
    """The function `package.module:function` names."""
    import importlib
    module, _, function = target.partition(":")
    try:
        return getattr(importlib.import_module(module), function)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"cannot load {what} '{target}' ({type(e).__name__}: {e}); make the module "
                          "importable (pip install it, or put its folder on PYTHONPATH) on every machine") from None


def mlx_lm_classes(spec: ModelSpec):
    """(Model, ModelArgs) of the mlx-lm architecture a preset names, its keys checked against ModelArgs."""
    from mlx_lm.utils import _get_classes
    try:
        model_cls, args_cls = _get_classes({"model_type": spec.type})
    except ValueError:
        raise ConfigError(f"model preset '{spec.name}' has unknown type '{spec.type}'; use gpt, cnn or an "
                          "mlx-lm model_type (llama, qwen3, mistral, ...)") from None
    known = set(inspect.signature(args_cls).parameters)
    for key in spec.params:
        if key not in known | {"type", "quantization"}:  # quantization: a 4-bit base, as in an mlx-lm folder's config
            raise ConfigError(f"model preset '{spec.name}': {spec.type} has no option '{key}'; "
                              f"{did_you_mean(key, sorted(known))}")
    return model_cls, args_cls


def build_model(spec: ModelSpec, seed: int = 0, lazy: bool = False) -> nn.Module:
    """Build the model, randomly initialised from `seed` (or with its weights, for a model folder).
    The vocabulary size is the preset's; the BPE tokenizer is trained to that size. `lazy` leaves
    the weights uncomputed: the model's shape without its memory (to count parameters)."""
    mx.random.seed(seed)
    params = {k: v for k, v in spec.params.items() if k != "type"}
    if spec.type == "gpt":
        from .gpt import GPT, GPTArgs
        model = GPT(GPTArgs.from_dict(params))
    elif spec.type == "cnn":
        from .cnn import CNN, CNNArgs
        model = CNN(CNNArgs.from_dict(params))
    elif spec.type == "mlx-lm":
        from mlx_lm.utils import load_model
        model, _ = load_model(spec.path)
    elif spec.type == "python":
        model = import_builder(spec.params["builder"])()
    else:
        model_cls, args_cls = mlx_lm_classes(spec)
        model = model_cls(args_cls.from_dict({**params, "model_type": spec.type}))
        if "quantization" in params:
            return quantize(model, params["quantization"], lazy)
    if not lazy:
        mx.eval(model.parameters())
    return model


def quantize(model: nn.Module, quantization: dict, lazy: bool) -> nn.Module:
    """A preset's model quantized as mlx_lm.convert does (mlx-lm's `quantize_model`): the layers
    that mlx-lm's load_model quantizes in a folder whose config.json has this "quantization".
    Unless `lazy`, evaluated a layer at a time: one layer's fp32 weights beside the packed ones
    (llama-1b-4bit: a peak of 0.95 GB, 1.32 GB evaluated at once)."""
    from mlx_lm.utils import quantize_model
    with contextlib.redirect_stdout(io.StringIO()):  # its "[INFO] Quantized model with N bits per weight"
        quantize_model(model, {}, quantization["group_size"], quantization["bits"], quantization.get("mode", "affine"))
    if not lazy:
        for _, layer in tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module):
            mx.eval(layer.parameters())
    return model


def count_parameters(model: nn.Module) -> int:
    """Its parameters; a quantized model's as mlx-lm counts them (packed weights as the values they
    hold, adapters left out)."""
    if any(hasattr(m, "bits") for m in model.modules()):
        from mlx_lm.utils import get_total_parameters
        return get_total_parameters(model)
    return sum(p.size for _, p in tree_flatten(model.parameters()))
