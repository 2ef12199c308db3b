"""Quorum rounds, after Decoupled DiLoCo (arXiv 2604.21428): the outer step does not wait for the
slowest worker.

Each worker steps at its own pace (speed-policy time: speeds.py) and *reports* once it has taken H
inner steps since its round began. An outer step happens at the first tick where at least K
workers have reported and `grace_steps` ticks have passed since the K-th did (at once when all M
have). It takes the weighted mean of the reported workers' pseudo-gradients, each against the
global model as it is now (the paper's merge; a straggler's values pull it back towards them)

    delta_w = global - local_w
    weight_w = tokens_w * (1 + s_w) ** -staleness_exponent

(tokens_w: the inner steps w took in its round, up to this tick; s_w: the outer steps the global
model took since w's round began) and steps the global model with the outer optimizer (DiLoCo's
OUTER_OPTIMIZERS). The workers it applied restart from the new global model; the others train on,
and count at a later outer step. The run ends with an outer step that applies every worker (a
plain weighted mean when none of them completed a round, as DiLoCo's short last round).

Why against the global model of now and not of the round's start: a straggler's progress since its
round began overlaps what the global model took meanwhile from the others, and counting it again
overshoots (mixed-home, 2 Macs, K = 1: eval loss 5.13 that way, the global model's swinging with
the two-round cycle; 4.50 this way; docs/results.md).

The schedule is a function of the workers' steps alone (Rounds), the same in the simulator and in
every process of a ring: at an outer step every worker takes part in one all-reduce, the workers
not applied with weight 0. With equal speeds everyone reports at once, and this is DiLoCo.

Where this departs from the paper: its grace window adapts, here it is a fixed number of ticks; its
merge weighs each learner by its tokens times its tokens per step (with the same batch for every
worker, inner steps here), the staleness factor is ours; and the whole model syncs at
once, not fragment by fragment.
"""

from dataclasses import dataclass

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from ..exchange.codecs import get_codec
from ..exchange.worker_axis import placeholders
from ..options import AUTO, NumberOrAuto, WholeOrAuto
from .base import NO_INPUTS, Strategy, TickInputs, codec_label, option
from .diloco import OUTER_OPTIMIZERS, outer_state_copies
from .outer_lr import MOMENTUM_HELP, auto_help, check_outer
from .fragments import OuterStore, gather, global_tree, partition, scatter


class Rounds:
    """Who reports when, and which workers an outer step applies, from the inner steps each job
    worker has taken (`taken`, given at every tick in order): plain integers, so every process
    agrees. `version[w]`: the outer steps done when w's round began; `base[w]`: its inner steps
    then; `reported[w]`: the tick it reported, or -1."""

    def __init__(self, workers: int, H: int, K: int, grace: int):
        self.M, self.H, self.K, self.grace = workers, H, K, grace
        self.base, self.version, self.reported = [0] * workers, [0] * workers, [-1] * workers
        self.outer_steps = 0
        self.quorum_at = -1  # the tick the K-th report came (-1: fewer than K so far)

    def tokens(self, taken: list) -> list:
        """Inner steps each worker has taken in its round."""
        return [n - b for n, b in zip(taken, self.base)]

    def advance(self, tick: int, taken: list):
        """Note the workers that have taken H steps in their round by `tick`."""
        for w, n in enumerate(self.tokens(taken)):
            if self.reported[w] < 0 and n >= self.H:
                self.reported[w] = tick
        if self.quorum_at < 0 and self.count() >= self.K:
            self.quorum_at = tick

    def count(self) -> int:
        return sum(r >= 0 for r in self.reported)

    def due(self, tick: int, final: bool) -> list:
        """The workers an outer step at `tick` applies: the reported ones once the quorum and its
        grace window are met, every worker at the end of the run; [] when there is none."""
        if final:
            return list(range(self.M))
        if self.count() == self.M or (self.quorum_at >= 0 and tick - self.quorum_at >= self.grace):
            return [w for w in range(self.M) if self.reported[w] >= 0]
        return []

    def weights(self, applied: list, taken: list, exponent: float) -> list:
        """Each job worker's weight in the outer step that applies `applied` (0 for the others)."""
        tokens = self.tokens(taken)
        return [tokens[w] * (1 + self.outer_steps - self.version[w]) ** -exponent if w in applied else 0.0
                for w in range(self.M)]

    def apply(self, applied: list, taken: list):
        """After the outer step: the applied workers begin a round from the new global model."""
        self.outer_steps += 1
        for w in applied:
            self.base[w], self.version[w], self.reported[w] = taken[w], self.outer_steps, -1
        self.quorum_at = -1  # every reported worker was applied

    def state(self) -> dict:
        return {"base": mx.array(self.base, mx.int64), "version": mx.array(self.version, mx.int64),
                "reported": mx.array(self.reported, mx.int64),
                "counts": mx.array([self.outer_steps, self.quorum_at], mx.int64)}

    def load_state(self, state: dict):
        self.base, self.version, self.reported = (state[k].tolist() for k in ("base", "version", "reported"))
        self.outer_steps, self.quorum_at = state["counts"].tolist()


@dataclass
class Quorum(Strategy):
    name = "quorum"
    keeps_global_model = True
    steps_can_differ = True  # workers exchange nothing between outer steps
    syncs_every_h = False    # an outer step comes when K workers have reported
    sync_every: WholeOrAuto = option(50, "H: inner steps a worker takes in a round before it reports (auto: as "
                                         "diloco's)")
    quorum: int = option(0, "K: reports of H inner steps an outer step waits for (0: every worker but one)")
    grace_steps: int = option(-1, "ticks an outer step waits for more reports once K workers have reported "
                                  "(-1: H/10)")
    staleness_exponent: float = option(1.0, "a pseudo-gradient counts its tokens times (1 + outer steps it "
                                            "missed) ** -exponent (0: its tokens alone)")
    outer_optimizer: str = option("nesterov", f"the outer step: {', '.join(OUTER_OPTIMIZERS)} "
                                              "(adam takes lr-sized steps: pass an outer-lr near 0.05)")
    outer_lr: NumberOrAuto = option(AUTO, auto_help())
    outer_momentum: NumberOrAuto = option(AUTO, MOMENTUM_HELP)
    compress: str = option("fp16", "codec of the pseudo-gradients (scales counted in the bytes)")

    def check(self):
        get_codec(self.compress)
        self.require(self.outer_optimizer in OUTER_OPTIMIZERS, f"outer-optimizer must be one of "
                     f"{', '.join(OUTER_OPTIMIZERS)} (got '{self.outer_optimizer}')")
        self.require(self.sync_every == AUTO or self.sync_every >= 1, f"sync-every (H) must be >= 1 or auto (got {self.sync_every})")
        self.require(self.quorum >= 0, f"quorum (K) must be >= 0 (got {self.quorum})")
        self.require(self.grace_steps >= -1, f"grace-steps must be >= 0, or -1 for H/10 (got {self.grace_steps})")
        self.require(self.staleness_exponent >= 0, f"staleness-exponent must be >= 0 (got {self.staleness_exponent})")
        check_outer(self)

    def label_options(self) -> list:
        words = super().label_options() + [f"outer {self.outer_optimizer}"] * (self.outer_optimizer != "nesterov")
        return words + codec_label(self.compress) + [f"K={self.quorum or 'M-1'}"]

    @property
    def outer_copies(self) -> int:
        """The global model and the outer optimizer's per-value state."""
        return 1 + outer_state_copies(self.outer_optimizer)

    def bind(self, comm, steps: int):
        M = comm.num_workers
        self.require(self.quorum <= M, f"quorum (K) is {self.quorum} but the job has {M} workers; pass --quorum {M} "
                     "or fewer")
        return super().bind(comm, steps)

    def setup(self, params):
        M, H = self.comm.num_workers, self.sync_every
        self.template = placeholders(params)  # the tree's shape, not its values
        self.pieces = partition(params, 1)[0]  # the whole model as one flat buffer
        self.store = OuterStore(gather({k: v[None] for k, v in tree_flatten(params)}, self.pieces)[0],
                                OUTER_OPTIMIZERS[self.outer_optimizer](self.outer_lr, self.outer_momentum))
        self.rounds = Rounds(M, H, self.quorum or max(M - 1, 1), H // 10 if self.grace_steps < 0 else self.grace_steps)

    def after_step(self, params, step, tick: TickInputs = NO_INPUTS):
        # each job worker's inner steps by now (workers at their own pace: training/pacing.py says)
        taken = tick.steps_taken or [step] * self.comm.num_workers
        self.rounds.advance(step, taken)
        applied = self.rounds.due(step, final=step == self.steps)
        if not applied:
            return params
        flat = dict(tree_flatten(params))
        del params  # flat holds the only references (Workers.take_params)
        return tree_unflatten(list(self._outer_step(flat, applied, taken, final=step == self.steps).items()))

    def _outer_step(self, flat: dict, applied: list, taken: list, final: bool) -> dict:
        rounds, M, local = self.rounds, self.comm.num_workers, self.comm.local_workers
        weights = rounds.weights(applied, taken, self.staleness_exponent)
        total = sum(weights)
        if total == 0:  # nobody stepped since the last outer step (a run's end right after one)
            return flat
        # The all-reduce's mean over M becomes the weighted mean over the applied workers. A worker
        # not applied sends 0 times its values: a NaN anywhere still stops the run here, named.
        factors = [M * weights[w] / total for w in local]
        old = self.store.global_values
        delta = (old[None] - gather(flat, self.pieces)) * mx.array(factors)[:, None]
        mean_delta = self.comm.start_mean(delta, get_codec(self.compress), tag="quorum outer step").result()
        if final and all(rounds.reported[w] < 0 for w in applied):
            # No worker completed a round: the weighted mean, as DiLoCo's short last round (an outer
            # step's momentum would carry the global model past the workers).
            new = old - mean_delta
            mx.eval(new)
            self.store.global_values = new
        else:
            outer = self.store.outer
            outer.state = self.store.outer_state
            new = outer.apply_gradients({"p": mean_delta}, {"p": old})["p"]
            mx.eval(new, outer.state)
            self.store.global_values, self.store.outer_state = new, outer.state
        rounds.apply(applied, taken)
        n = len(local)
        if all(w in applied for w in local):
            merged = mx.broadcast_to(new[None], (n, new.size))
        else:
            restart = mx.array([w in applied for w in local])[:, None]
            merged = mx.where(restart, new[None], gather(flat, self.pieces))
        out = scatter(flat, self.pieces, merged)
        mx.eval(list(out.values()))
        return out

    def outer_steps_done(self, steps: int) -> int:
        return self.rounds.outer_steps  # they come when K workers have reported, not every H steps

    def global_params(self, params):
        return global_tree(self.template, [(self.pieces, self.store.global_values)])

    def global_from_state(self, template, saved):
        return global_tree(template, [(partition(template, 1)[0], saved.strategy["global"])])

    def state(self) -> dict:
        return {"global": self.store.global_values, "outer": self.store.outer_state, "rounds": self.rounds.state()}

    def load_state(self, state: dict):
        self.store.global_values, self.store.outer_state = state["global"], state["outer"]
        self.rounds.load_state(state["rounds"])
