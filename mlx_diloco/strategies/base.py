"""The strategy interface: what every low-communication algorithm implements, once, for the
simulator and the real cluster alike.

A strategy is a dataclass whose fields are its options (`DiLoCo(sync_every=100, outer_lr=0.7)`):
each value is type-checked on construction, `check()` adds the ranges, and a misspelled option is
an error with a did-you-mean hint. `for_job(workers, steps)` gives `auto` options their numbers for
a job (the one place they are worked out). The run then binds it to a communicator (`bind`) and
calls its hooks around every inner step:

    inner_optimizer(config)        the optimizer of the inner steps (default: AdamW from the config)
    setup(params)                  once, with the shared initial parameters (no worker axis)
    reduce_gradients(grads, step)  before the inner update (DDP averages here)
    after_step(params, step, tick) after it (DiLoCo's outer step happens here every H steps); `tick`:
                                   TickInputs, what the run knows of this tick (each worker's weight
                                   at a sync, the inner steps each has taken)
    global_params(params)          the model to evaluate and export (no worker axis)
    state() / load_state(state)    what a checkpoint holds beside the workers' parameters

and answers what the rest of the package asks of it, so that nothing outside strategies/ tests
its name or reads its options: `label()` (plots, scorecards), `schedule` (when its workers meet:
sync points, an exchange's delay), `global_from_state(template, saved)` (export),
`steps_can_differ` (speed-policy time), `syncs_every_h` (membership, elastic jobs), `own_state`
(who may join), `outer_copies`, `worker_copies`, `sync_pieces`, `offloads_outer` and
`memory_savings` (memory estimates), `keeps_global_model`.

Parameters and gradients carry a leading local-worker axis (see exchange/comm.py). `step` is the job-wide
inner step counter, which every worker agrees on, so a sync schedule can never drift.
"""

from dataclasses import asdict, dataclass, fields

import mlx.core as mx
import mlx.optimizers as optim
from mlx.utils import tree_flatten

from ..exchange.worker_axis import replica
from ..models.precision import random_word, round_bf16_stochastically
from ..options import AUTO, ConfigError, checked_value, did_you_mean, option  # noqa: F401 (option: strategies import it from here)
from ..schedules.schedule import SyncSchedule
from .outer_lr import with_auto_outer


def lr_schedule(config, peak: float = None):
    """Linear warmup to `peak` (default: the config's lr), then cosine decay to its final-lr fraction."""
    peak = config.lr if peak is None else peak
    warmup = min(config.warmup_steps(), config.steps - 1)
    cosine = optim.cosine_decay(peak, max(config.steps - warmup, 1), end=peak * config.final_lr)
    return optim.join_schedules([optim.linear_schedule(0.0, peak, warmup), cosine], [warmup]) \
        if warmup > 0 else cosine


class AdamW(optim.AdamW):
    """MLX's AdamW with its moments held in `moments_dtype`, every update computed in fp32 and
    rounded to the parameter's dtype, stochastically for bf16 (all fp32: MLX's AdamW)."""

    def __init__(self, *args, moments_dtype=mx.float32, **kwargs):
        super().__init__(*args, **kwargs)
        self.moments_dtype = moments_dtype

    def init_single(self, parameter, state):
        state["m"] = mx.zeros(parameter.shape, self.moments_dtype)
        state["v"] = mx.zeros(parameter.shape, self.moments_dtype)

    def apply_gradients(self, gradients, parameters):
        # One draw of random bits for every bf16 parameter's rounding (models/precision.py); none for fp32
        if any(p.dtype == mx.bfloat16 for _, p in tree_flatten(parameters)):
            self.rounding_seed = random_word()
        return super().apply_gradients(gradients, parameters)

    def apply_single(self, gradient, parameter, state):
        new = super().apply_single(gradient.astype(mx.float32), parameter.astype(mx.float32), state)
        state["m"], state["v"] = state["m"].astype(self.moments_dtype), state["v"].astype(self.moments_dtype)
        if parameter.dtype == mx.bfloat16:  # no fp32 master copy: stochastic rounding keeps small updates
            return round_bf16_stochastically(new, self.rounding_seed)
        return new.astype(parameter.dtype)


def default_inner_optimizer(config) -> optim.AdamW:
    """AdamW as PyTorch and the DiLoCo papers use it: bias correction, warmup then cosine."""
    return AdamW(learning_rate=lr_schedule(config), betas=[config.beta1, config.beta2], eps=1e-8,
                 weight_decay=config.weight_decay, bias_correction=True,
                 moments_dtype=mx.bfloat16 if config.moments_precision == "bf16" else mx.float32)


@dataclass(frozen=True)
class TickInputs:
    """What the run tells a strategy's `after_step` of the tick (training/pacing.py works it out): under
    speed-policy time or a membership schedule, workers take different numbers of inner steps."""
    # The factors on what each local worker sends at a sync (speeds.py), or {fragment offset: factors}
    # when the fragments' windows differ (membership.py); None: equal.
    sync_weights: object = None
    # Each job worker's inner steps after this tick (a strategy whose schedule follows them: quorum.py);
    # None: the tick's number, for every worker.
    steps_taken: list = None

    def weights_of(self, offset: int) -> list:
        """The factors on what each local worker sends of the fragment at `offset` (None: equal)."""
        w = self.sync_weights
        return w.get(offset) if isinstance(w, dict) else w


NO_INPUTS = TickInputs()  # every worker steps every tick, and counts alike


def codec_label(codec: str, error_feedback: bool = False) -> list:
    """A label's word for a codec other than the default fp16 ('int4+ef' with error feedback)."""
    return [] if codec in (None, "fp16") else [codec + ("+ef" if error_feedback else "")]


class Strategy:
    name = "base"
    clip_gradients = True  # the run clips each worker's gradients (grad-clip) before the inner update
    # Workers may take different numbers of inner steps between syncs (speed-policy time, a
    # membership schedule): only for strategies that exchange nothing between syncs. The run then
    # passes each tick's weights and steps taken to `after_step` (TickInputs).
    steps_can_differ = False
    # Model-sized fp32 arrays held in memory between syncs (DiLoCo: the global model and its outer
    # optimizer's state): what memory.py counts for the strategy beside the replicas; and those
    # each local worker keeps of its own (an error-feedback buffer), counted once per worker.
    outer_copies = 0
    worker_copies = 0
    sync_pieces = 1         # the model is synced in this many pieces, one at a time (Streaming's fragments)
    offloads_outer = False  # its outer state waits in files between syncs, out of the training memory
    # Its syncs come every H ticks, at its fragments' offsets: what membership changes, a joiner's
    # catch-up and an elastic cluster rely on (quorum rounds' outer steps come when workers report).
    syncs_every_h = True
    keeps_global_model = False  # its global model is not a worker's (DiLoCo's outer step keeps one)
    # What each worker keeps of its own beside its replica ("": nothing): a worker joining mid-run
    # cannot take it from a peer, and one leaving would take it away (membership.py, run.py).
    own_state = ""

    def __new__(cls, *args, **options):
        names = [f.name for f in fields(cls)] if hasattr(cls, "__dataclass_fields__") else []
        for key in options:
            if key not in names:
                raise ConfigError(f"strategy {cls.name} has no option '{key}'; "
                                  f"{did_you_mean(key, names, valid='its options')}")
        return super().__new__(cls)

    def __post_init__(self):
        for f in fields(self):
            setattr(self, f.name, checked_value(f.name, getattr(self, f.name), f.type, f.default))
        self.check()

    def check(self):
        """Raise ConfigError for option values out of range."""

    def options(self) -> dict:
        return asdict(self) if hasattr(self, "__dataclass_fields__") else {}

    def for_job(self, workers: int, steps: int) -> "Strategy":
        """This strategy with every `auto` option given its number for a job of `workers` workers and
        `steps` inner steps (a new one where one changes: a composite builds its parts from its
        options). The one place `auto` is worked out: training/resolve.py and the API call it before
        the run records its options, and `bind` refuses a strategy still holding one."""
        return with_auto_outer(self, workers, steps)[0]

    @property
    def sync_every(self) -> int:
        """Inner steps between the strategy's periodic syncs (0: it has none)."""
        return 0

    @property
    def schedule(self) -> SyncSchedule:
        """When this strategy's workers meet (schedule.py): every sync_every steps (a strategy of
        fragments or overlapped exchanges gives its offsets and delay)."""
        return SyncSchedule(self.sync_every)

    def memory_savings(self, blocks: int) -> list:
        """[(option, value)]: this strategy's own options that shrink a worker's memory, in the order
        worth trying, for a model of `blocks` transformer blocks (memory.make_it_fit)."""
        return []

    def outer_steps_done(self, steps: int):
        """Outer steps (syncs) done after `steps` inner steps and their `after_step`, for the metrics
        (None: it has none)."""
        return -(-steps // self.sync_every) if self.sync_every else None

    def label(self) -> str:
        """A short name for plots and scorecards: the strategy and the options that set a run apart."""
        return " ".join([self.name, *self.label_options()])

    def label_options(self) -> list:
        """The label's words after the name: H, where the strategy syncs every H steps; a strategy adds
        its own options' words."""
        return [f"H={self.sync_every}"] if self.sync_every else []

    def require(self, ok: bool, message: str):
        if not ok:
            raise ConfigError(f"{self.name}: {message}")

    # ---- the run
    def bind(self, comm, steps: int):
        """The communicator, and the run's step count (a run always ends synced)."""
        if auto := [k for k, v in self.options().items() if v == AUTO]:
            raise ConfigError(f"{self.name}: {', '.join(auto)} still '{AUTO}': make the strategy for its job with "
                              f"for_job(workers, steps) before binding it")
        self.comm, self.steps = comm, steps
        return self

    def check_model(self, spec, adapted_blocks: int = None):
        """Refuse a model the options do not fit, before any data is read (spec: modelzoo.ModelSpec;
        adapted_blocks: the blocks that carry adapters, which are all that trains, or None when every
        weight trains: models/finetune.py)."""

    def inner_optimizer(self, config) -> optim.Optimizer:
        return default_inner_optimizer(config)

    def setup(self, params):
        pass

    def reduce_gradients(self, grads, step: int):
        return grads

    def after_step(self, params, step: int, tick: TickInputs = NO_INPUTS):
        return params

    def global_params(self, params):
        return replica(params)

    def global_from_state(self, template, saved):
        """The global model a checkpoint holds (`saved`: its arrays, records.SavedArrays: the workers'
        parameters, and this strategy's `state()` as saved), without building a run: here worker 0's
        parameters (the replicas are equal, or end so); `template`, a model's parameters, gives the
        shapes and dtypes where needed."""
        return replica(saved.params)

    def state(self) -> dict:
        return {}

    def load_state(self, state: dict):
        pass


def mean_gradients(comm, grads, codec: str):
    """Data-parallel averaging of (n_local, ...) gradients; every local worker gets the mean."""
    if comm.num_workers == 1:
        return grads
    return comm.broadcast_local(comm.all_mean(grads, codec, tag="gradients"))

