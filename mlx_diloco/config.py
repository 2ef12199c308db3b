"""Run configuration: one dataclass with every training setting, checked on the way in."""

import difflib
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path


class ConfigError(ValueError):
    """Bad user input; the CLI prints it as one line and exits non-zero."""


def checked_value(name: str, value, kind):
    """`value` as field type `kind` (bool, int, float or str), or a ConfigError naming the key.
    An int is a float too; nothing else is converted ("4" is not 4, 20.5 is not an int)."""
    flag = name.replace("_", "-")
    ok = {bool: lambda v: isinstance(v, bool),
          int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          str: lambda v: isinstance(v, str)}.get(kind)
    if ok is None:  # a field of another type (a list, a dict): the dataclass checks it
        return value
    if not ok(value):
        example = {bool: "true or false", int: "a whole number", float: "a number", str: "a string"}[kind]
        raise ConfigError(f"{flag} must be {example}, not {json.dumps(value)}; "
                          f"write e.g. \"{name}\": {json.dumps(kind() if kind is not bool else True)}")
    return float(value) if kind is float else value


def from_dict(cls, params, what: str):
    """Build dataclass `cls` from `params`, rejecting unknown keys with a did-you-mean hint and
    values of the wrong type with a line that names the key."""
    if not isinstance(params, dict):
        raise ConfigError(f"{what}s must be a JSON object ({{\"key\": value, ...}}), "
                          f"not a {type(params).__name__}")
    types = {f.name: f.type for f in fields(cls)}
    for key in params:
        if key not in types:
            close = difflib.get_close_matches(key, list(types), n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"valid: {', '.join(types)}"
            raise ConfigError(f"unknown {what} '{key}'; {hint}")
    return cls(**{k: checked_value(k, v, types[k]) for k, v in params.items()})


STRATEGIES = ("diloco", "ddp", "fedavg")
FRAGMENT_ORDERS = ("strided", "sequential")
DEFAULT_MAX_SEQ_LEN = 1024  # what seq-len 0 stands for at most (a model folder may allow 32K)


@dataclass
class TrainConfig:
    # What to train on
    model: str = "small"            # preset name (models/*.json), a preset JSON file, or an mlx-lm model folder
    data: str = "shakespeare"       # 'shakespeare' (embedded), 'fashion-mnist', a text file or a folder of .txt
    tokenizer: str = ""             # '' trains a byte-level BPE on the corpus; or an HF/mlx-lm tokenizer folder
    seq_len: int = 0                # 0: the model's context length, at most DEFAULT_MAX_SEQ_LEN
    batch_size: int = 16            # sequences per worker per inner step
    # The simulated (or real) cluster
    workers: int = 4
    strategy: str = "diloco"
    sync_every: int = 50            # H: inner steps between outer steps
    steps: int = 500                # inner steps per worker
    # Inner optimizer: AdamW with PyTorch-equivalent settings
    lr: float = 1e-3
    warmup: int = 50
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0          # per-worker global-norm clip; 0 disables
    # Outer optimizer: SGD with Nesterov momentum on the pseudo-gradient
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    # The exchange, and Streaming DiLoCo (arXiv 2501.18512)
    compress: str = "fp16"          # codec of exchanged values: fp32, fp16, bf16, int8, int4, e3m0, int2
    error_feedback: bool = False    # add what compression lost to the next pseudo-gradient
    fragments: int = 1              # P: fragments of the model, synced at staggered steps
    fragment_order: str = "strided" # block l in fragment l mod P, or contiguous runs ("sequential")
    overlap_steps: int = 0          # tau: inner steps an exchange overlaps before it is applied
    merge_alpha: float = -1.0       # weight of the local values when a result lands; -1: 0.5 if tau > 0, else 0
    # Evaluation, bookkeeping
    eval_every: int = 0             # inner steps between evaluations; 0 = every outer step (or 50 for ddp)
    eval_batches: int = 8
    seed: int = 0
    link: str = "1gbe"              # network preset (or 'BW[/LATENCY]', e.g. '100mbit/20ms') for the time model
    vectorize: bool = True          # train simulated workers with mx.vmap (False: one after another)

    @classmethod
    def from_dict(cls, params: dict) -> "TrainConfig":
        return from_dict(cls, params, what="config key").validated()

    @classmethod
    def from_file(cls, path) -> "TrainConfig":
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist; pass the path of a JSON config")
        try:
            params = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"config file {path} is not valid JSON ({e.msg} at line {e.lineno})")
        return cls.from_dict(params)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def resolved_merge_alpha(self) -> float:
        if self.merge_alpha >= 0:
            return self.merge_alpha
        return 0.5 if self.overlap_steps > 0 else 0.0

    @property
    def checkpoint_every(self) -> int:
        """Checkpoints are taken at outer-step boundaries, where every worker holds the global model."""
        return self.sync_every if self.strategy != "ddp" else self.resolved_eval_every

    @property
    def resolved_eval_every(self) -> int:
        if self.eval_every:
            return self.eval_every
        return self.sync_every if self.strategy != "ddp" else 50

    def validated(self) -> "TrainConfig":
        def need(ok, msg):
            if not ok:
                raise ConfigError(msg)
        need(self.workers >= 1, f"workers must be >= 1 (got {self.workers}); pass --workers 1 or more")
        need(self.sync_every >= 1, f"sync-every (H) must be >= 1 (got {self.sync_every}); pass --sync-every 1 or more")
        need(self.steps >= 1, f"steps must be >= 1 (got {self.steps})")
        need(self.batch_size >= 1, f"batch-size must be >= 1 (got {self.batch_size})")
        need(self.seq_len == 0 or self.seq_len >= 2, f"seq-len must be >= 2, or 0 for the model's context (got {self.seq_len})")
        need(self.lr > 0, f"lr must be > 0 (got {self.lr})")
        need(self.warmup >= 0, f"warmup must be >= 0 steps (got {self.warmup})")
        need(self.weight_decay >= 0, f"weight-decay must be >= 0 (got {self.weight_decay})")
        for name in ("beta1", "beta2"):
            need(0 <= getattr(self, name) < 1, f"{name} must be in [0, 1) (got {getattr(self, name)})")
        need(self.grad_clip >= 0, f"grad-clip must be >= 0, 0 disables it (got {self.grad_clip})")
        need(self.outer_lr > 0, f"outer-lr must be > 0 (got {self.outer_lr})")
        need(0 <= self.outer_momentum < 1, f"outer-momentum must be in [0, 1) (got {self.outer_momentum})")
        need(self.eval_every >= 0 and self.eval_batches >= 1, "eval-every must be >= 0 and eval-batches >= 1")
        need(self.strategy in STRATEGIES, f"unknown strategy '{self.strategy}'; choose one of {', '.join(STRATEGIES)}")
        from .codecs import CODECS  # here, not at the top: reading a config needs no MLX until now
        need(self.compress in CODECS, f"unknown codec '{self.compress}'; choose one of {', '.join(CODECS)}")
        need(self.fragments >= 1, f"fragments must be >= 1 (got {self.fragments})")
        need(self.fragment_order in FRAGMENT_ORDERS,
             f"unknown fragment-order '{self.fragment_order}'; choose one of {', '.join(FRAGMENT_ORDERS)}")
        need(0 <= self.overlap_steps < self.sync_every,
             f"overlap-steps must be in [0, H) = [0, {self.sync_every}) (got {self.overlap_steps})")
        need(self.merge_alpha == -1 or 0 <= self.merge_alpha <= 1,
             f"merge-alpha must be in [0, 1] (got {self.merge_alpha})")
        need(self.strategy != "ddp" or (self.fragments == 1 and self.overlap_steps == 0 and not self.error_feedback),
             "fragments, overlap-steps and error-feedback belong to diloco and fedavg, not ddp")
        return self
