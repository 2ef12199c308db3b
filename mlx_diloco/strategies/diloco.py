"""DiLoCo (arXiv 2311.08105), its streaming form (arXiv 2501.18512), and FedAvg.

Every H steps each fragment of the model takes an outer step on the workers' mean
pseudo-gradient  delta = global - local, with the optimizer its `outer_optimizer` names
(OUTER_OPTIMIZERS: Nesterov momentum as the paper, heavy-ball SGD, Adam). With one fragment, no
overlap and no merge this is DiLoCo; with P fragments their syncs are spread evenly over H
(fragment p at offset H(p+1)/P mod H), each exchange is applied tau inner steps after it starts,
and the result is merged into the local models with weight alpha on the local values
(fragments.py holds the mechanics).
`ddp_warmup_steps` K trains data-parallel first, as the DiLoCo paper's main runs start from a
pre-trained model; the outer schedule then counts from K.
"""

from dataclasses import dataclass

import mlx.core as mx
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_unflatten

from ..exchange.codecs import get_codec
from ..exchange.worker_axis import placeholders
from ..options import AUTO, ConfigError, NumberOrAuto, WholeOrAuto
from ..schedules.schedule import SyncSchedule
from .base import NO_INPUTS, Strategy, TickInputs, codec_label, mean_gradients, option
from .fragments import Fragment, gather, global_tree, offload_folder, partition
from .outer_lr import MOMENTUM_HELP, auto_help, check_outer


OUTER_OPTIMIZERS = {  # the outer optimizer by name, from its learning rate and momentum
    # DiLoCo's: Nesterov momentum (plain SGD with momentum 0)
    "nesterov": lambda lr, momentum: optim.SGD(learning_rate=lr, momentum=momentum, nesterov=momentum > 0),
    # heavy-ball momentum: v <- m v + delta, global <- global - lr v
    "sgd": lambda lr, momentum: optim.SGD(learning_rate=lr, momentum=momentum),
    # Adam with beta1 = outer-momentum. beta2 0.99, not 0.999: runs take tens to hundreds of outer
    # steps, and 0.999 would average the squares over a thousand. Bias correction: without it m
    # warms up faster than sqrt(v), and outer steps 5 to 30 run 1.8-2.1x lr. eps 1e-8: far below
    # a pseudo-gradient's values (those of fine-tuning included).
    "adam": lambda lr, momentum: optim.Adam(learning_rate=lr, betas=[momentum, 0.99], eps=1e-8, bias_correction=True),
}


def outer_state_copies(outer_optimizer: str) -> int:
    """Model-sized arrays an outer optimizer keeps per value (its learning rate changes none)."""
    probe = OUTER_OPTIMIZERS[outer_optimizer](1.0, 0.9)
    probe.init({"p": mx.zeros(1)})
    return len(probe.state["p"])


@dataclass
class DiLoCo(Strategy):
    name = "diloco"
    keeps_global_model = True
    sync_every: WholeOrAuto = option(50, "H: inner steps between a fragment's outer steps, or auto: the smallest "
                                         "that keeps the exchanges within 5 percent of the wall-clock (sync_period.py)")
    outer_optimizer: str = option("nesterov", f"the outer step: {', '.join(OUTER_OPTIMIZERS)} "
                                              "(adam takes lr-sized steps: pass an outer-lr near 0.05)")
    outer_lr: NumberOrAuto = option(AUTO, auto_help())
    outer_momentum: NumberOrAuto = option(AUTO, MOMENTUM_HELP)
    compress: str = option("fp16", "codec of the pseudo-gradients (scales counted in the bytes)")
    error_feedback: bool = option(False, "add what compression lost to the next pseudo-gradient")
    fragments: int = option(1, "P: fragments of the model, each synced every H steps at its own offset")
    fragment_order: str = option("strided", "strided (block l in fragment l mod P) or sequential")
    overlap_steps: int = option(0, "tau: inner steps an exchange runs beside compute before it lands")
    merge_alpha: float = option(-1.0, "weight of the local values when a result lands (-1: 0.5 with overlap, else 0)")
    ddp_warmup_steps: int = option(0, "K: train data-parallel for the first K steps, then DiLoCo")
    offload_outer: bool = option(False, "keep the global model and outer momentum in files between syncs, "
                                        "out of the training memory (8 bytes/parameter)")

    def check(self):
        get_codec(self.compress)
        self.require(self.outer_optimizer in OUTER_OPTIMIZERS, f"outer-optimizer must be one of "
                     f"{', '.join(OUTER_OPTIMIZERS)} (got '{self.outer_optimizer}')")
        self.require(self.sync_every == AUTO or self.sync_every >= 1, f"sync-every (H) must be >= 1 or auto (got {self.sync_every})")
        check_outer(self)
        self.require(self.fragments >= 1, f"fragments must be >= 1 (got {self.fragments})")
        self.require(self.fragment_order in ("strided", "sequential"),
                     f"fragment-order must be strided or sequential (got '{self.fragment_order}')")
        self.require(0 <= self.overlap_steps and (self.sync_every == AUTO or self.overlap_steps < self.sync_every),
                     f"overlap-steps must be in [0, H) = [0, {self.sync_every}) (got {self.overlap_steps})")
        self.require(self.merge_alpha == -1 or 0 <= self.merge_alpha <= 1,
                     f"merge-alpha must be in [0, 1] (got {self.merge_alpha})")
        self.require(self.ddp_warmup_steps >= 0, f"ddp-warmup-steps must be >= 0 (got {self.ddp_warmup_steps})")

    def check_model(self, spec, adapted_blocks=None):
        if adapted_blocks is not None and self.fragments > max(adapted_blocks, 1):  # fragments of the adapters
            raise ConfigError(f"{self.fragments} fragments but only {adapted_blocks} blocks of model '{spec.name}' "
                              f"have adapters; pass --fragments {max(adapted_blocks, 1)} or fewer, or a larger "
                              "--num-layers")
        if self.fragments > max(spec.num_blocks, 1):
            raise ConfigError(f"{self.fragments} fragments but model '{spec.name}' has {spec.num_blocks} blocks; "
                              f"pass --fragments {max(spec.num_blocks, 1)} or fewer")

    @property
    def alpha(self) -> float:
        if self.merge_alpha >= 0:
            return self.merge_alpha
        return 0.5 if self.overlap_steps > 0 else 0.0

    @property
    def steps_can_differ(self) -> bool:
        """Workers may step at their own pace between syncs, but not while data parallel."""
        return self.ddp_warmup_steps == 0

    @property
    def worker_copies(self) -> int:
        return int(self.error_feedback)  # what compression lost, per worker (fp32)

    @property
    def own_state(self) -> str:
        parts = [("an exchange in flight (overlap-steps)", self.overlap_steps),
                 ("what compression lost (error-feedback)", self.error_feedback)]
        return " and ".join(what for what, on in parts if on)

    @property
    def outer_copies(self) -> int:
        """The global values and the outer optimizer's per-value state (in files when offloaded)."""
        return 0 if self.offload_outer else 1 + outer_state_copies(self.outer_optimizer)

    @property
    def sync_pieces(self) -> int:
        return self.fragments

    @property
    def offloads_outer(self) -> bool:
        return self.offload_outer

    def memory_savings(self, blocks: int) -> list:
        """Offloading the outer state, then fragments of two blocks each (a sync's buffers are one's)."""
        return [("offload_outer", True), ("fragments", max(blocks // 2, self.fragments, 1))]

    @property
    def schedule(self) -> SyncSchedule:
        """Every H steps, fragment p at offset H(p+1)/P mod H; an exchange lands overlap-steps after it starts."""
        H, P = self.sync_every, self.fragments
        return SyncSchedule(H, tuple(H * (p + 1) // P % H for p in range(P)), self.overlap_steps)

    def label_options(self) -> list:
        words = super().label_options()
        words += [f"P={self.fragments}"] * (self.fragments > 1) + [f"tau={self.overlap_steps}"] * (self.overlap_steps > 0)
        words += [f"outer {self.outer_optimizer}"] * (self.outer_optimizer != "nesterov")
        return words + codec_label(self.compress, self.error_feedback)

    def make_outer_optimizer(self) -> optim.Optimizer:
        """One fragment's outer optimizer (each fragment keeps its own state)."""
        return OUTER_OPTIMIZERS[self.outer_optimizer](self.outer_lr, self.outer_momentum)

    def setup(self, params):
        P, H = self.fragments, self.sync_every
        # The tree's shape, not its values: holding the initial weights would keep a model's worth of memory.
        self.template = placeholders(params)
        flat = {k: v[None] for k, v in tree_flatten(params)}
        # Scratch files for the offloaded outer state, removed with the strategy.
        self.offload_dir = offload_folder() if self.offload_outer else None
        offsets = self.schedule.offsets
        self.model_fragments = [  # one Fragment (its global values, outer state, exchange) per part of the model
            Fragment(p, pieces, gather(flat, pieces)[0], self.make_outer_optimizer(), H, offset=offsets[p],
                     delay=self.overlap_steps, alpha=self.alpha, codec=get_codec(self.compress),
                     error_feedback=self.error_feedback, n_local=self.comm.n_local,
                     offload_dir=self.offload_dir and self.offload_dir.name)
            for p, pieces in enumerate(partition(params, P, self.fragment_order))]

    def reduce_gradients(self, grads, step):
        if step <= self.ddp_warmup_steps:
            return mean_gradients(self.comm, grads, self.compress)
        return grads

    def after_step(self, params, step, tick: TickInputs = NO_INPUTS):
        K = self.ddp_warmup_steps
        if step <= K:  # data parallel: the replicas are equal, and at the end of it the global model
            if step == K or step == self.steps:
                flat = {k: v[:1] for k, v in tree_flatten(params)}
                for f in self.model_fragments:
                    f.global_values = gather(flat, f.pieces)[0]
            return params
        final = step == self.steps
        if not final and not any(f.is_send_step(step - K) or f.apply_at == step for f in self.model_fragments):
            return params  # most steps: nothing to sync
        flat = dict(tree_flatten(params))
        del params  # flat holds the only references (Workers.take_params): each goes as it is replaced
        if final:  # the end: land what is in flight, then sync every fragment now
            for f in self.model_fragments:
                if f.pending is not None:
                    flat = f.perform_sync(flat)
                f.prepare_sync(flat, self.comm, step, tick.weights_of(f.offset))
                flat = f.perform_sync(flat, final=True, short_round=f.round_length(step - K) < self.sync_every)
        else:
            for f in self.model_fragments:   # every worker starts the fragments' exchanges in the same order
                if f.is_send_step(step - K):
                    f.prepare_sync(flat, self.comm, step, tick.weights_of(f.offset))
                    if f.apply_at == step:  # no overlap: land it now, so that fragments syncing at
                        flat = f.perform_sync(flat)  # one step (H < P) hold one's buffers at a time
            for f in self.model_fragments:
                if f.pending is not None and f.apply_at == step:
                    flat = f.perform_sync(flat)
        return tree_unflatten(list(flat.items()))

    def global_params(self, params):
        # A generator: an offloaded fragment's values are read from its file when their turn comes,
        # and dropped after (a list would keep every fragment's fp32 values: 4.4 GB for llama-1b).
        return global_tree(self.template, ((f.pieces, f.global_values) for f in self.model_fragments))

    def state(self):
        return {"fragments": [f.state() for f in self.model_fragments]}

    def load_state(self, state):
        for f in self.model_fragments:
            f.load_state(state["fragments"][f.index], self.comm)

    def global_from_state(self, template, saved):
        """The fragments' global values in their places, in the dtypes of `template`."""
        fragments = saved.strategy["fragments"]
        pieces = partition(template, len(fragments), self.fragment_order)
        return global_tree(template, [(p, f["global"]) for p, f in zip(pieces, fragments)])


@dataclass
class FedAvg(DiLoCo):
    """FedAvg / Local SGD: the global model becomes the workers' mean (outer lr 1, no momentum)."""
    name = "fedavg"
    outer_lr: float = option(1.0, "outer learning rate: 1 (the global model is the workers' mean)")
    outer_momentum: float = option(0.0, "outer momentum: 0")

    def check(self):
        super().check()
        self.require(self.outer_lr == 1 and self.outer_momentum == 0 and self.outer_optimizer != "adam",
                     "FedAvg is DiLoCo with outer lr 1 and no momentum; for other values use diloco")
