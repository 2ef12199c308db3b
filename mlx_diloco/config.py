"""Run configuration: one dataclass with every training setting, checked on the way in.

Below it: options.py (errors, typed values, did-you-mean), the strategies (whose options a flat
config carries), exchange/network.py and speeds.py (which parse the link and the worker
speeds). None of them imports this module; training/run.py's `resolve` turns a config into the
run's (config, strategy, model spec)."""

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from .exchange.network import parse_link
from .options import ConfigError, did_you_mean, from_dict, read_json  # ConfigError: most callers import it from here
from .speeds import Speeds


PRECISIONS = ("fp32", "bf16")
MAX_AUTO_WARMUP = 50  # warmup -1: a fifth of the run, at most this many steps (TrainConfig.warmup_steps)
DEFAULT_MAX_SEQ_LEN = 1024  # what seq-len 0 stands for at most (a model folder may allow 32K)


@dataclass
class TrainConfig:
    # What to train on
    model: str = "small"            # preset name (models/*.json), a preset JSON file, or an mlx-lm model folder
    data: str = "shakespeare"       # 'shakespeare' (embedded), 'fashion-mnist', a text file or a folder of .txt
    tokenizer: str = ""             # '' trains a byte-level BPE on the corpus; or an HF/mlx-lm tokenizer folder
    seq_len: int = 0                # 0: the model's context length, at most DEFAULT_MAX_SEQ_LEN
    batch_size: int = 16            # sequences per worker per inner step
    # The simulated (or real) cluster, and the strategy (strategies/: its options are its own)
    workers: int = 4
    strategy: str = "diloco"
    strategy_options: dict = field(default_factory=dict)  # e.g. {"sync_every": 50}; flat in files and flags
    steps: int = 500                # inner steps per worker
    # Inner optimizer: AdamW with PyTorch-equivalent settings
    lr: float = 1e-3
    warmup: int = -1                # linear warmup steps; -1: a fifth of the run, at most 50 (warmup_steps)
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0          # per-worker global-norm clip; 0 disables
    # Evaluation, bookkeeping
    eval_every: int = 0             # inner steps between evaluations; 0 = every outer step (or 50 for ddp)
    eval_batches: int = 8
    seed: int = 0
    link: str = "1gbe"              # network preset (or 'BW[/LATENCY]', e.g. '100mbit/20ms') for the time model
    step_time: float = 0.0          # modelled seconds of a speed-1 inner step (0: as measured here)
    worker_speeds: str = ""         # relative speeds, one per worker ('1,1,0.5,0.25'); '' all equal
    speed_policy: str = "fixed"     # fixed (H steps each, fast workers wait) or time (speeds.py)
    vectorize: bool = True          # train simulated workers with mx.vmap (False: one after another)
    loss: str = ""                  # '' cross-entropy; or an importable loss function 'package.module:function'
    # Memory (issue 11): what the replicas are stored and computed in
    precision: str = "fp32"         # fp32, or bf16: weights, activations, gradients (models/precision.py)
    moments_precision: str = "fp32"  # AdamW's moments: fp32, or bf16 (half their memory)
    grad_checkpoint: bool = False   # recompute each block's activations in the backward pass (models/checkpointing.py)
    memory_limit: float = 0.0       # GB per process that MLX keeps to (0: MLX's default); see training/run.py

    @classmethod
    def from_dict(cls, params: dict, check_strategy: bool = True) -> "TrainConfig":
        """Config keys and the strategy's options side by side ({"strategy": "diloco", "sync_every": 50});
        every key is checked against the config and the chosen strategy, every value against its type.
        `check_strategy=False` checks the config's own keys only and keeps the rest as strategy
        options, unchecked: for the agent, which must not import MLX (its worker checks them)."""
        if not isinstance(params, dict):
            return from_dict(cls, params, what="config key")  # the one-line error for a non-object
        own = {f.name for f in fields(cls)}
        if not check_strategy:
            config = from_dict(cls, {k: v for k, v in params.items() if k in own}, what="config key")
            config.strategy_options = {k: v for k, v in params.items() if k not in own}
            config.check_values()
            return config
        from .strategies import STRATEGIES, strategy_class  # here, not on top: the agent reads configs without MLX
        name = params.get("strategy", cls.strategy)
        theirs = {f.name for f in fields(strategy_class(name))} if isinstance(name, str) else set()
        options = dict(params.get("strategy_options") or {})
        for key in params:
            if key in theirs:
                options[key] = params[key]
            elif key not in own:
                others = [n for n, c in STRATEGIES.items() if key in {f.name for f in fields(c)}]
                if others:
                    raise ConfigError(f"'{key}' is an option of {', '.join(others)}, not of strategy {name}")
                raise ConfigError(f"unknown config key '{key}'; {did_you_mean(key, sorted(own | theirs))}")
        config = from_dict(cls, {k: v for k, v in params.items() if k in own and k != "strategy_options"},
                           what="config key")
        config.strategy_options = options
        return config.validated()

    @classmethod
    def from_file(cls, path) -> "TrainConfig":
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist; pass the path of a JSON config")
        return cls.from_dict(read_json(path, "a config file", 'pass a JSON config ({"workers": 4, ...})'))

    def to_dict(self) -> dict:
        """Flat, as in config files: the strategy's options beside the config keys."""
        flat = asdict(self)
        return {**{k: v for k, v in flat.items() if k != "strategy_options"}, **flat["strategy_options"]}

    def make_strategy(self):
        """The strategy this config names, with its options (checked there)."""
        from .strategies import make_strategy  # on call, as in from_dict: strategies import MLX
        return make_strategy(self.strategy, self.strategy_options)

    def warmup_steps(self) -> int:
        """The learning rate's warmup in steps: as set, or (-1) a fifth of the run, at most 50 steps,
        so that a short run is not spent warming up (60 steps: 12, not 50; 250 steps or more: 50)."""
        return self.warmup if self.warmup >= 0 else min(MAX_AUTO_WARMUP, self.steps // 5)

    def validated(self) -> "TrainConfig":
        self.check_values()
        self.check_strategy(self.make_strategy())  # its options: names, types, ranges
        return self

    def check_strategy(self, strategy):
        """What the config asks of `strategy`: speed-policy time paces workers between syncs, so
        the strategy must exchange nothing between them, and every worker must step in a round."""
        if self.speed_policy != "time":
            return
        if not strategy.steps_can_differ or getattr(strategy, "ddp_warmup_steps", 0):
            raise ConfigError(f"speed-policy time needs a strategy that exchanges only at its syncs "
                              f"(diloco, fedavg, muloco; no ddp-warmup-steps), not {strategy.name}; "
                              "use --speed-policy fixed")
        speeds, H = Speeds.of(self), strategy.sync_every
        if speeds and min(steps := speeds.steps_taken(H)) == 0:
            slow = steps.index(0)
            raise ConfigError(f"worker {slow} (speed {speeds.speeds[slow]:g}) takes no step in a round of "
                              f"H = {H} ticks; raise --sync-every or its speed")

    def check_values(self):
        """Ranges of the config's own values (the strategy checks its options)."""
        def need(ok, msg):
            if not ok:
                raise ConfigError(msg)
        need(self.workers >= 1, f"workers must be >= 1 (got {self.workers}); pass --workers 1 or more")
        need(self.steps >= 1, f"steps must be >= 1 (got {self.steps})")
        need(self.batch_size >= 1, f"batch-size must be >= 1 (got {self.batch_size})")
        need(self.seq_len == 0 or self.seq_len >= 2, f"seq-len must be >= 2, or 0 for the model's context (got {self.seq_len})")
        need(self.lr > 0, f"lr must be > 0 (got {self.lr})")
        need(self.warmup >= -1, f"warmup must be >= 0 steps, or -1 for a fifth of the run (got {self.warmup})")
        need(self.weight_decay >= 0, f"weight-decay must be >= 0 (got {self.weight_decay})")
        for name in ("beta1", "beta2"):
            need(0 <= getattr(self, name) < 1, f"{name} must be in [0, 1) (got {getattr(self, name)})")
        need(self.grad_clip >= 0, f"grad-clip must be >= 0, 0 disables it (got {self.grad_clip})")
        need(self.eval_every >= 0 and self.eval_batches >= 1, "eval-every must be >= 0 and eval-batches >= 1")
        for key in ("precision", "moments_precision"):
            need(getattr(self, key) in PRECISIONS,
                 f"{key.replace('_', '-')} must be one of {', '.join(PRECISIONS)} (got '{getattr(self, key)}')")
        Speeds.of(self)  # the worker speeds and their policy
        parse_link(self.link)  # a preset or 'BW[/LATENCY]'
        need(self.step_time >= 0, f"step-time must be >= 0 seconds, 0 to measure it (got {self.step_time})")
        need(self.memory_limit >= 0, f"memory-limit must be >= 0 GB, 0 for MLX's default (got {self.memory_limit})")
        need(not self.loss or ":" in self.loss, f"loss '{self.loss}' must name a function as 'package.module:function'")
