"""Config files in mlx-lm's YAML (`mlx-diloco sim --config lora.yaml`): the keys of `mlx_lm.lora`'s
config that mean the same thing here, under their mlx-lm names, as this project's config keys; and
mlx-lm-lora's (`train_mode: grpo`, `reward_functions: [...]`: its preference and RL training).

The one place that knows mlx-lm's keys. Every key of mlx-lm's config (its lora.py CONFIG_DEFAULTS
and examples/lora_config.yaml) is one of:
- renamed (`iters` -> steps, `learning_rate` -> lr, `lora_parameters` -> lora_rank, ...) or kept
  under its own name (`model`, `data`, `seed`, ...);
- served otherwise here (`adapter_path`, `save_every`, ...): one note line, and the run goes on;
- a request this project cannot honour (another optimizer, `resume_adapter_file`, `hf_dataset`):
  one ConfigError line naming the key and the fix.
Keys that are this project's own (`workers: 4`, `strategy`, `sync_every`) pass through, so one YAML
file can hold both. Keys the file leaves out keep this project's defaults, not mlx-lm's. MLX-free."""

import re
import sys

import yaml

from .options import ConfigError

# mlx-lm's key -> this project's, same meaning; then mlx-lm-lora's (its preference and RL training:
# objectives/), whose other keys (beta, group_size, epsilon, ...) are ours too.
RENAMED = {"iters": "steps", "learning_rate": "lr", "max_seq_length": "seq_len",
           "steps_per_eval": "eval_every", "val_batches": "eval_batches",
           "train_mode": "objective", "train_type": "fine_tune_type", "reward_functions_file": "reward_file"}
# mlx-lm-lora's lists, as our comma-separated strings.
LISTS = ("reward_functions", "reward_weights")
# Keys whose null means "none" (our default).
UNSET_BY_NULL = ("report_to", "project_name", "reward_functions_file", "reward_functions", "reward_weights",
                 "epsilon_high")
# lora_parameters' keys -> this project's (models/finetune.py hands them to linear_to_lora_layers).
LORA_PARAMETERS = {"rank": "lora_rank", "scale": "lora_scale", "dropout": "lora_dropout", "keys": "lora_keys"}
# Kept under their own names; listed so that a version without one says so (see `translate`).
SAME_NAME = ("model", "data", "seed", "batch_size", "grad_checkpoint", "fine_tune_type", "num_layers",
             "mask_prompt", "report_to", "project_name")
# Served otherwise here: a note says how, and the key is dropped. No note where the value asks
# for nothing (null, false, 0).
NOTES = {
    "adapter_path": "the adapters are written to RUN/adapters/ of the run folder (--run-dir RUN)",
    "save_every": "a checkpoint (and RUN/adapters/) is written at every outer step",
    "steps_per_report": "the loss is reported every step (progress bar, RUN/metrics.jsonl)",
    "test": "no test-set pass here; run mlx_lm.lora --test --adapter-path RUN/adapters after",
    "test_batches": "no test-set pass here",
    "lr_schedule": "the schedule here is a linear warmup (--warmup) then a cosine decay from lr",
    "clear_cache_threshold": "MLX's cache is left to --memory-limit",
    "trust_remote_code": "tokenizers are loaded without remote code",
}
# Requests this project cannot carry out, unless they hold these values (mlx-lm's defaults of them).
HARMLESS = {"train": (True, None), "training_mode": ("normal", None), "grad_accumulation_steps": (1, None),
            "resume_adapter_file": (None, ""), "hf_dataset": (None, False),
            "dpo_cpo_loss_type": ("sigmoid", None), "importance_sampling_level": ("token", None),
            "reference_model_path": (None, "")}
READ_ELSEWHERE = ("optimizer", "optimizer_config", "config")  # `optimizer`; a file's `config` is moot
OPTIMIZERS = ("adam", "adamw")  # the inner optimizer is AdamW; Adam is AdamW without weight decay


class Loader(yaml.SafeLoader):
    """YAML as mlx_lm.lora reads it: `1e-5` is a float (YAML 1.1 would read a string)."""


Loader.add_implicit_resolver(  # mlx_lm/lora.py's resolver (that module imports MLX)
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:
     [-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+][0-9]+)?
    |[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\.[0-9_]*
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."))


def read_yaml_config(path, own_keys) -> dict:
    """The config in YAML file `path`, mlx-lm's keys as this project's (`translate`), each note
    printed as one line on stderr; or one ConfigError line naming the file and the line."""
    try:
        params = yaml.load(path.read_bytes().decode("utf-8"), Loader)
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not a config file: it is not text; pass a YAML or JSON config") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{path} is not valid YAML ({problem}{where}); "
                          "write one 'key: value' per line, e.g. 'iters: 1000'") from None
    if params is None:  # an empty file, or only comments
        params = {}
    if not isinstance(params, dict):
        raise ConfigError(f"{path} must hold 'key: value' lines (e.g. 'iters: 1000'), not a {type(params).__name__}")
    params, notes = translate(params, own_keys)
    for note in notes:
        print(f"note: {path}: {note}", file=sys.stderr)
    return params


def translate(params: dict, own_keys) -> tuple:
    """(this project's config, notes): `params` with mlx-lm's keys renamed, the ones served
    otherwise dropped with a note each, and a ConfigError line for what cannot be honoured.
    `own_keys`: TrainConfig's fields (a key that maps to none is refused, not taken for a
    strategy option)."""
    config, notes, sources = {}, [], {}

    def put(source, key, value):
        if key in config:
            raise ConfigError(f"{sources[key]} and {source} both set {key}; keep one")
        config[key], sources[key] = value, source

    def counterpart(mlx_key, key):
        if key not in own_keys:
            raise ConfigError(f"mlx-lm's {mlx_key} has no counterpart ({key}) in this version; remove it")
        return key

    refuse_what_cannot_be_honoured(params)
    for key, value in params.items():
        if key in UNSET_BY_NULL and value is None:  # mlx-lm's (and mlx-lm-lora's) default: none
            continue
        if key in RENAMED:
            put(key, counterpart(key, RENAMED[key]), value)
        elif key == "lora_parameters":
            for name, v in lora_parameters(value).items():
                put(f"lora_parameters.{name}", counterpart(f"lora_parameters.{name}", LORA_PARAMETERS[name]), v)
        elif key in LISTS:
            put(key, key, comma_separated(key, value))
        elif key in own_keys or key in SAME_NAME:  # ours too
            put(key, counterpart(key, key), value)
        elif key in NOTES:
            if value not in (None, False, 0, ""):
                notes.append(f"{key} is ignored: {NOTES[key]}")
        elif key not in HARMLESS and key not in READ_ELSEWHERE:
            put(key, key, value)  # a strategy option (sync_every): its strategy checks it
    for key, value in optimizer(params).items():
        put("optimizer", key, value)
    if params.get("val_batches") == -1:
        raise ConfigError("val_batches -1 (the whole validation set) is not supported here; "
                          "give a number of batches, e.g. val_batches: 25")
    return config, notes


def lora_parameters(value) -> dict:
    """mlx-lm's lora_parameters, its `keys` (a list of layer paths) as lora_keys' comma-separated string."""
    if not isinstance(value, dict) or set(value) - LORA_PARAMETERS.keys():
        raise ConfigError(f"lora_parameters must hold {', '.join(LORA_PARAMETERS)} "
                          f"(e.g. {{rank: 8, scale: 20.0, dropout: 0.0}}), not {value!r}")
    keys = value.get("keys")
    if keys is None:
        return {k: v for k, v in value.items() if k != "keys"}
    if not (isinstance(keys, list) and keys and all(isinstance(k, str) and k and "," not in k for k in keys)):
        raise ConfigError(f"lora_parameters.keys must be a list of layer paths in a block, e.g. "
                          f"[self_attn.q_proj, self_attn.v_proj], not {keys!r}")
    return {**value, "keys": ",".join(keys)}


def comma_separated(key: str, value):
    """mlx-lm-lora's list (YAML's, or its CLI's string "[0.7, 0.3]") as our comma-separated string."""
    if isinstance(value, str):
        return value.strip().strip("[]")
    if isinstance(value, list) and all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in value):
        return ",".join(str(v) for v in value)
    raise ConfigError(f"{key} must be a list (e.g. [exact_answer, format] or [1.0, 0.5]), not {value!r}")


def refuse_what_cannot_be_honoured(params: dict):
    """One ConfigError line for an mlx-lm key whose request this project cannot carry out."""
    fixes = {
        "train": "this command trains: remove 'train: false' (to evaluate only, use mlx_lm.lora --test)",
        "training_mode": "only normal (next-token) training here: remove training_mode",
        "resume_adapter_file": "starting from saved adapters is not supported; remove it "
                               "(to continue a run: --resume --run-dir RUN)",
        "hf_dataset": "Hugging Face datasets are not downloaded here; set data to a folder with "
                      "train.jsonl and valid.jsonl",
        "dpo_cpo_loss_type": "DPO's loss here is the sigmoid one: remove it",
        "importance_sampling_level": "GRPO's ratio here is per token: remove it",
        "reference_model_path": "the reference here is the starting model (the base with the adapters off); "
                                "remove it",
    }
    for key, fix in fixes.items():
        if params.get(key) not in HARMLESS[key]:
            raise ConfigError(f"{key}: {params[key]!r}: {fix}")
    accumulate, batch = params.get("grad_accumulation_steps"), params.get("batch_size")
    if accumulate not in HARMLESS["grad_accumulation_steps"]:
        same = f" ({batch * accumulate})" if isinstance(batch, int) and isinstance(accumulate, int) else ""
        raise ConfigError(f"grad_accumulation_steps {accumulate} is not supported here; for the same batch per "
                          f"step, multiply batch_size by it{same} and remove it")


def optimizer(params: dict) -> dict:
    """The inner AdamW's keys for mlx-lm's `optimizer` and its `optimizer_config` (betas,
    weight_decay): Adam is AdamW with no weight decay."""
    name = params.get("optimizer")
    if name is None:
        return {}
    if name not in OPTIMIZERS:
        raise ConfigError(f"optimizer {name!r} is not supported: the inner optimizer here is AdamW; "
                          "set optimizer: adamw (or adam, without weight decay)")
    settings = (params.get("optimizer_config") or {}).get(name) or {}
    unknown = set(settings) - {"betas", "weight_decay"}
    if unknown:
        raise ConfigError(f"optimizer_config.{name}.{sorted(unknown)[0]} is not supported here; "
                          "only betas and weight_decay (remove it)")
    keys = {"weight_decay": settings.get("weight_decay", 0.0 if name == "adam" else None)}
    if "betas" in settings:
        betas = settings["betas"]
        if not (isinstance(betas, list) and len(betas) == 2):
            raise ConfigError(f"optimizer_config.{name}.betas must be two numbers, e.g. [0.9, 0.999], not {betas!r}")
        keys["beta1"], keys["beta2"] = betas
    return {k: v for k, v in keys.items() if v is not None}
