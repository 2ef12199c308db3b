"""What a config names, built and checked together in one place: the run's config as it will be
recorded, its strategy and its model spec (`resolve`: the one place a process builds the run's
strategy from its config, and where its options are checked), and the model, data and strategy a run
trains (`Parts`), from a config or from the caller (the Python API)."""

from dataclasses import dataclass, fields, replace
from pathlib import Path

from ..run_folder import latest_step
from ..config import DEFAULT_MAX_SEQ_LEN, ConfigError, TrainConfig
from ..data.datasets import EMBEDDED, FASHION_MNIST, is_fashion_mnist_folder, load_shard, prepare
from ..data.post_training import load_post_training, load_post_training_shard
from ..models.finetune import adapted_blocks, check_fine_tune
from ..models.zoo import build_model, import_builder, load_spec
from ..objectives import kind as objective_kind, objective_class
from ..options import AUTO
from ..strategies import make_strategy, strategy_class
from ..strategies.outer_lr import DEFAULT_BEFORE_AUTO, explain
from . import checkpoint
from .period import has_period, with_period


def saved_config(run_dir: Path) -> TrainConfig:
    """The config of the run in `run_dir`, as its newest checkpoint recorded it."""
    if latest_step(run_dir) is None:
        raise ConfigError(f"nothing to resume in {run_dir}: no checkpoint; drop --resume to start a new run")
    _, meta = checkpoint.load(run_dir, log=lambda m: None)  # Run._restore says which one it uses
    return as_it_ran(TrainConfig.from_dict(meta["config"]))


def as_it_ran(config: TrainConfig) -> TrainConfig:
    """A saved run's config, its outer lr and momentum as the run trained with them: one saved
    before auto that left them to their defaults trained with DEFAULT_BEFORE_AUTO's, and resumes so."""
    defaults = {f.name: f.default for f in fields(strategy_class(config.strategy))}
    before = {k: v for k, v in DEFAULT_BEFORE_AUTO.items()
              if defaults.get(k) == AUTO and k not in config.strategy_options}
    return replace(config, strategy_options={**config.strategy_options, **before}) if before else config


def strategy_for_job(strategy, config: TrainConfig, values: int = None, api: bool = False) -> tuple:
    """(the strategy with its `auto` options given their numbers for the config's job, the config recording
    them, the lines that say what was chosen and why): the one call that works them out, for the
    config's workers, steps and link: the sync period first (training/period.py: the outer step's rule
    reads H), then the rest (Strategy.for_job). `api`: the Python API's model, which its config does not
    name: the period is worked out (from `values`, what trains) only for sync-every auto."""
    notes, given = [], strategy.options()
    if has_period(strategy) and (not api or strategy.sync_every == AUTO):
        strategy, notes = with_period(config, strategy, values)
    notes += [why] if (why := explain(strategy, config.workers, config.steps)) else []
    job = strategy.for_job(config.workers, config.steps)
    worked_out = job.options()
    if worked_out != given:  # recorded as the numbers
        config = replace(config, strategy_options={**config.strategy_options,
                                                   **{k: v for k, v in worked_out.items() if v != given.get(k)}})
    return job, config, notes


@dataclass
class Resolved:
    """What a config names, built and checked together once (`resolve`)."""
    config: TrainConfig           # as the run will use and record it
    strategy: object              # the run's strategies.Strategy, with the config's options
    spec: object                  # the model's models.zoo.ModelSpec
    notes: tuple = ()             # what was changed from the config as given, for the run to say once


def resolve(config: TrainConfig) -> Resolved:
    """The config as the run will use and record it (local paths made absolute, so the run folder
    works from any directory; seq-len 0 replaced by the model's context; outer-lr auto replaced by
    its number), with its strategy and model spec, each checked against the others. The strategy
    first: a misspelled option is the first thing said, before a model or data is looked for."""
    strategy, config, notes = strategy_for_job(make_strategy(config.strategy, config.strategy_options), config)
    config.check_strategy(strategy)

    def absolute(path: str, names=()):
        return str(Path(path).resolve()) if path and path not in names and Path(path).exists() else path
    config = replace(config, model=absolute(config.model) if Path(config.model).is_dir() or
                     config.model.endswith(".json") else config.model,
                     data=absolute(config.data, names=(EMBEDDED, FASHION_MNIST)),
                     tokenizer=absolute(config.tokenizer))
    spec = load_spec(config.model)
    arrays = config.data.endswith(".npz")  # examples as arrays (the API's data): any model, no tokens
    images = config.data == FASHION_MNIST or is_fashion_mnist_folder(config.data)
    if not arrays and spec.is_language_model == images:
        raise ConfigError(f"model '{config.model}' does not fit data '{config.data}': "
                          "the cnn preset trains on fashion-mnist, language models on text")
    check_fine_tune(config, spec)
    blocks = adapted_blocks(config, spec.num_blocks)
    if spec.num_blocks and blocks is not None and config.num_layers > blocks:
        notes.append(f"num-layers {config.num_layers} is more than the model's {blocks} blocks: adapters on all "
                     f"{blocks}, as mlx-lm puts them")
        config = replace(config, num_layers=blocks)
    objective = objective_class(config.objective)
    objective.check_model(config, spec)
    notes += objective.notes(config)
    strategy.check_model(spec, adapted_blocks(config, spec.num_blocks))  # adapters: what the strategy exchanges
    if config.seq_len == 0 and spec.is_language_model and not arrays:
        config = replace(config, seq_len=min(spec.context_length, DEFAULT_MAX_SEQ_LEN))
    if spec.is_language_model and config.seq_len > spec.context_length:
        raise ConfigError(f"seq-len {config.seq_len} exceeds model '{config.model}' context "
                          f"{spec.context_length}; pass --seq-len {spec.context_length} or less")
    return Resolved(config, strategy, spec, tuple(notes))


def load_data(config: TrainConfig, spec, log=print, shard_dir=None):
    """The corpus named in the config (tokenized, cached), or a shard shipped to this worker."""
    tokenizer = config.tokenizer or (str(spec.path) if spec.path else "")
    post_training = objective_kind(config.objective).post_training  # preference pairs or prompts
    if shard_dir and post_training:
        data = load_post_training_shard(shard_dir, tokenizer)
    elif shard_dir:
        data = load_shard(shard_dir)
    elif post_training:
        data = load_post_training(config.objective, config.data, tokenizer, config.seq_len,
                                  config.max_completion_length, log)
    else:
        data = prepare(config.data, config.seq_len, spec.vocab_size or 0, tokenizer, log=log,
                       mask_prompt=config.mask_prompt)
    if data.vocab_size and spec.vocab_size and data.vocab_size > spec.vocab_size:
        raise ConfigError(f"tokenizer has {data.vocab_size} tokens but model '{config.model}' only "
                          f"{spec.vocab_size}; use a model preset with a larger vocab_size")
    return data


@dataclass
class Parts:
    """What a run trains, when the caller builds it (the Python API) rather than the config."""
    model: object                 # an mlx.nn.Module
    data: object                  # a data.Dataset: train and held-out examples
    strategy: object              # a strategies.Strategy
    loss: object = None           # loss(model, x, y) -> scalar; default: cross-entropy on model(x)
    vectorize: object = "auto"    # True, False, or "auto": vmap the replicas if the model allows it
    spec: object = None           # a models.zoo.ModelSpec, for runs of presets (checkpoints record it)


def parts_from_config(resolved: Resolved, log=print, shard_dir=None) -> Parts:
    """The model, data and strategy a resolved config names (the CLI, the cluster worker)."""
    config, spec = resolved.config, resolved.spec
    data = load_data(config, spec, log=log, shard_dir=shard_dir)
    loss = import_builder(config.loss, "loss function") if config.loss else None
    # "auto": vmapped unless MLX cannot vmap the model (conv2d's gradient), which the first step shows.
    return Parts(build_model(spec, seed=config.seed), data, resolved.strategy, loss=loss,
                 vectorize="auto" if config.vectorize else False, spec=spec)
