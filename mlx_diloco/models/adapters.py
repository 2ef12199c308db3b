"""A fine-tune's output in mlx-lm's adapter layout, and its fusion into the base model.

A fine-tuning run (LoRA, DoRA, or full on the last layers: models/finetune.py) writes, with each
checkpoint, its global model's trainable parameters to RUN/adapters/ (the newest checkpoint's):
`adapters.safetensors` and `adapter_config.json`, as `mlx_lm.lora` writes them, so that
`mlx_lm.generate --model BASE --adapter-path RUN/adapters` and `mlx_lm.fuse` read them as they are.
The checkpoint itself stays the run's own (outer state, cursors): this folder is its output.
"""

import json
import os
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from ..atomic import atomic_write_text
from ..options import ConfigError

ADAPTERS = "adapters"                 # RUN/adapters/: the newest checkpoint's global adapters
WEIGHTS = "adapters.safetensors"      # the names mlx_lm.tuner.utils.load_adapters reads
CONFIG = "adapter_config.json"


def save_adapters(folder, trainable_params, adapter_config: dict) -> Path:
    """Write `trainable_params` (the global model's trainable tree: the adapters) and
    `adapter_config` (mlx-lm's keys: model, fine_tune_type, num_layers, lora_parameters) to
    `folder`. The base model's path is made absolute, so the folder is usable from anywhere.
    Each file is replaced whole: a reader never sees a torn one."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = dict(adapter_config)
    base = config.get("model")
    if base and Path(base).exists():  # a folder; else a hub name, kept as it is
        config["model"] = str(Path(base).resolve())
    atomic_write_text(folder / CONFIG, json.dumps(dict(sorted(config.items())), indent=4))
    tmp = folder / f".{WEIGHTS}.tmp.safetensors"
    mx.save_safetensors(str(tmp), dict(tree_flatten(trainable_params)))
    os.replace(tmp, folder / WEIGHTS)
    return folder


def read_adapter_config(folder) -> dict:
    path = Path(folder) / CONFIG
    if not path.is_file():
        raise ConfigError(f"{folder} has no {CONFIG}; pass a fine-tuning run (trained with --fine-tune-type) "
                          f"or its {ADAPTERS}/ folder")
    return json.loads(path.read_text())


def adapters_of(run_or_folder) -> Path:
    """The adapters folder of a run (RUN/adapters), or the folder itself when it holds them."""
    path = Path(run_or_folder)
    return path if (path / CONFIG).is_file() else path / ADAPTERS


def load_with_adapters(adapters, return_config: bool = False):
    """(model, tokenizer[, config]) of the base model the adapters name, with them applied:
    mlx-lm's own loader, as `mlx_lm.generate --adapter-path` does."""
    from mlx_lm.utils import load
    base = read_adapter_config(adapters)["model"]
    return load(base, adapter_path=str(adapters), return_config=return_config)


def fuse(adapters, out, dequantize: bool = False) -> Path:
    """Fuse the adapters into their base model and save it to `out` as an mlx-lm model folder:
    mlx_lm.fuse's steps (its loader, each adapted layer's own `fuse`, its `save`)."""
    from mlx_lm.utils import dequantize_model, save
    model, tokenizer, config = load_with_adapters(adapters, return_config=True)
    fused = [(name, m.fuse(dequantize=dequantize)) for name, m in model.named_modules() if hasattr(m, "fuse")]
    if fused:
        model.update_modules(tree_unflatten(fused))
    if dequantize:
        model = dequantize_model(model)
        config.pop("quantization", None)
        config.pop("quantization_config", None)
    save(Path(out), read_adapter_config(adapters)["model"], model, tokenizer, config, donate_model=False)
    return Path(out)
