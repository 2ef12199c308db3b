"""Load a trained model back from a run's checkpoint, and export it for mlx-lm."""

import shutil
from pathlib import Path

import mlx.core as mx

from ..config import ConfigError, TrainConfig
from ..models import adapters
from ..models.zoo import ModelSpec, build_model, load_spec
from ..records import META, SavedArrays
from ..strategies import make_strategy
from ..training import checkpoint


def load_trained_model(run_dir):
    """(model with the global parameters, its ModelSpec, the run's tokenizer folder or None)."""
    run_dir = Path(run_dir)
    arrays, meta = checkpoint.load(run_dir)
    spec = ModelSpec(meta[META.config]["model"], meta[META.model_preset])
    if spec.type == "mlx-lm":  # the base model's folder on this machine (a hub name: in its own cache)
        spec.path = load_spec(meta[META.config]["model"]).path
    model = build_model(spec)
    model.update(global_parameters(model, arrays, meta))
    mx.eval(model.parameters())
    tokenizer = run_dir / "tokenizer"
    return model, spec, tokenizer if tokenizer.is_dir() else None


def trained_model(run_dir):
    """The run's trained model: a fine-tune's base with its adapters (RUN/adapters, as mlx-lm loads
    them), else the checkpoint's global model."""
    if (adapters_dir := adapters.adapters_of(run_dir)).is_dir():
        return adapters.load_with_adapters(adapters_dir)[0]
    return load_trained_model(run_dir)[0]


def global_parameters(model, arrays: dict, meta: dict) -> dict:
    """The global model a checkpoint holds, in the dtypes of `model`'s parameters, as the run's
    strategy (built from the checkpoint's config) reads it from the checkpoint's arrays."""
    config = TrainConfig.from_dict(meta[META.config])
    strategy = make_strategy(config.strategy, config.strategy_options)
    return strategy.global_from_state(model.trainable_parameters(), SavedArrays.of(arrays))


def export_mlx_lm(run_dir, out_dir, fuse: bool = False) -> Path:
    """Write an mlx-lm model folder (weights, config.json, tokenizer) for runs of mlx-lm architectures.
    A fine-tuning run (one with RUN/adapters) exports its adapters folder, or with `fuse` the base
    model with its adapters fused in."""
    from mlx_lm.utils import save_config, save_model
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"output folder {out} is not empty; export into a new or empty folder")
    if (adapters_dir := adapters.adapters_of(run_dir)).is_dir():
        return adapters.fuse(adapters_dir, out) if fuse else Path(shutil.copytree(adapters_dir, out, dirs_exist_ok=True))
    if fuse:
        raise ConfigError(f"run {run_dir} has no {adapters.ADAPTERS}/ folder: only a fine-tuning run "
                          "(--fine-tune-type lora or dora) has adapters to fuse; drop --fuse")
    model, spec, tokenizer = load_trained_model(run_dir)
    if spec.type in ("gpt", "cnn", "python"):
        raise ConfigError(f"model type '{spec.type}' has no mlx-lm architecture; export works for presets of "
                          "mlx-lm architectures (llama, qwen3, ...) and model folders (use 'generate' for the others)")
    out.mkdir(parents=True, exist_ok=True)
    save_model(out, model)
    config = {k: v for k, v in spec.params.items() if k != "type"}
    config.setdefault("model_type", spec.type)
    save_config(config, out / "config.json")
    if tokenizer:
        for f in tokenizer.iterdir():
            shutil.copy(f, out / f.name)
    return out
