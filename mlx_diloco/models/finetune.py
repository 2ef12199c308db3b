"""Fine-tuning types, as mlx-lm names them (config: fine-tune-type, num-layers, lora-rank,
lora-scale, lora-dropout, lora-keys):

    full        every weight trains (the default, and what pretraining does)
    lora, dora  the base frozen; adapters on the linear layers of the last num-layers blocks
                (lora-keys: only those named), made by mlx-lm's own `linear_to_lora_layers`. A quantized base (QLoRA) stays as
                it is: only its adapters train.

The run trains and its strategy exchanges `model.trainable_parameters()`: with adapters, those
are the adapters alone (pseudo-gradients, outer state, codecs and byte counts all count them).
`adapter_config` is what mlx-lm's adapter_config.json holds, so that mlx_lm.generate and
mlx_lm.fuse rebuild the same adapters.
"""

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..options import ConfigError

ADAPTER_TYPES = ("lora", "dora")


def lora_parameters(config) -> dict:
    """mlx-lm's `lora_parameters` (what linear_to_lora_layers takes): "keys", the layers' paths in
    a block, only when lora-keys names them (without it, mlx-lm takes every linear layer)."""
    parameters = {"rank": config.lora_rank, "scale": config.lora_scale, "dropout": config.lora_dropout}
    if keys := lora_keys(config):
        parameters["keys"] = keys
    return parameters


def lora_keys(config) -> list:
    return [key.strip() for key in config.lora_keys.split(",") if key.strip()]


def adapter_config(config) -> dict:
    """The keys of mlx-lm's adapter_config.json that its load_adapters and fuse read (full
    fine-tuning: lora_parameters None, as mlx_lm.lora writes it); lora_parameters also holds the two
    that mlx-lm-lora writes there (use_dora, num_layers), so the file is a superset of both."""
    adapted = config.fine_tune_type in ADAPTER_TYPES
    return {"fine_tune_type": config.fine_tune_type, "num_layers": config.num_layers,
            "lora_parameters": {**lora_parameters(config), "use_dora": config.fine_tune_type == "dora",
                                "num_layers": config.num_layers} if adapted else None}


def adapted_blocks(config, num_blocks: int):
    """How many blocks get adapters (None: full fine-tuning, every block trains)."""
    if config.fine_tune_type not in ADAPTER_TYPES:
        return None
    return num_blocks if config.num_layers == -1 else min(config.num_layers, num_blocks)


def check_fine_tune(config, spec):
    """Before any data is read: adapters need an mlx-lm model."""
    if config.fine_tune_type not in ADAPTER_TYPES:
        return
    if spec.type in ("gpt", "cnn"):
        raise ConfigError(f"fine-tune-type {config.fine_tune_type} needs an mlx-lm model (a model folder, or a "
                          f"preset of an mlx-lm type such as llama); the {spec.type} preset has no `layers` to put "
                          "adapters on; use --fine-tune-type full")


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for m in model.modules())


def apply_fine_tune(model: nn.Module, config) -> nn.Module:
    """The model as the config's fine-tune type trains it: as it is (full), or frozen with
    trainable adapters (lora, dora)."""
    kind = config.fine_tune_type
    if kind not in ADAPTER_TYPES:
        if is_quantized(model):  # its packed weights cannot train: only the norms would
            raise ConfigError("a quantized model trains adapters only (QLoRA); pass --fine-tune-type lora "
                              "(or dora), or a model (folder or preset) that is not quantized")
        return model
    layers = getattr(model, "layers", None)
    if not isinstance(layers, list) or not layers:
        raise ConfigError(f"fine-tune-type {kind} needs an mlx-lm model, whose blocks are `model.layers`; "
                          "this model has none; use --fine-tune-type full")
    from mlx_lm.tuner.utils import linear_to_lora_layers
    model.freeze()  # the base; the adapters made next are trainable
    check_lora_keys(config, model)
    linear_to_lora_layers(model, config.num_layers, lora_parameters(config), use_dora=kind == "dora")
    if not tree_flatten(model.trainable_parameters()):
        raise ConfigError(f"fine-tune-type {kind}: the model's blocks have no linear layers to put adapters on; "
                          "use --fine-tune-type full")
    return model


def check_lora_keys(config, model: nn.Module):
    """Each lora-keys path names a layer of a block (or of the model, as mlx-lm also allows):
    mlx-lm would skip a misspelled one silently."""
    names = {name for name, _ in model.layers[-1].named_modules()} | {name for name, _ in model.named_modules()}
    for key in lora_keys(config):
        if key not in names:
            linears = sorted(name for name, m in model.layers[-1].named_modules()
                             if isinstance(m, (nn.Linear, nn.QuantizedLinear)))
            raise ConfigError(f"lora-keys: no layer '{key}' in the model's blocks; name layers as paths in a block, "
                              f"e.g. {','.join(linears[:2])} (its linear layers: {', '.join(linears)})")


def trainable_count(model: nn.Module) -> int:
    return sum(p.size for _, p in tree_flatten(model.trainable_parameters()))


def frozen_bytes(model: nn.Module, precision: str) -> int:
    """Bytes of the frozen weights in training (one copy, shared by a process's replicas): as
    stored (a quantized base: its packed size), floating ones in bf16 with precision bf16."""
    trainable = {k for k, _ in tree_flatten(model.trainable_parameters())}
    total = 0
    for path, p in tree_flatten(model.parameters()):
        if path not in trainable:
            total += p.size * 2 if precision == "bf16" and mx.issubdtype(p.dtype, mx.floating) else p.nbytes
    return total
