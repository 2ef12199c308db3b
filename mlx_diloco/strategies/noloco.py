"""NoLoCo, No-all-reduce Low Communication training (arXiv 2506.10911): DiLoCo without the all-reduce.

There is no global model: each worker keeps its own outer weights phi (the last outer step's) and
outer momentum m. Every H inner steps the workers meet in pairs, and worker i, paired with j,
averages its weights theta_i with theta_j (one exchange: each sends its weights once), then takes
the outer step

    m_i   <- beta m_i + eta ((theta_i + theta_j) / 2 - phi_i)
    phi_i <- phi_i + m_i,   theta_i <- phi_i

This follows the authors' code, github.com/jkolehm/noloco, src/noloco/sparse_optimizer_c.py
(outer_step; the paper's NoLoCo runs, configs/no_reduce_exp/*/*noloco_mean*.yaml, use it with
local_group_size 2). There, m_i <- beta m_i + eta mean(theta - phi) + eta (mean(phi) - phi_i), the
means over the pair: the pair's mean pseudo-gradient, plus the pull of phi_i toward the pair's mean
outer weights, with the pull's weight (the paper's gamma) equal to the outer lr. The two means add
up to mean(theta) - phi_i, so one exchange of the weights does (the code sends phi and theta - phi:
twice the bytes). Its momentum is heavy-ball (phi moves by the new m), as written above. Defaults
from those configs: H = 50, eta = 0.7, beta = 0.5, pairs of 2.

The code exchanges fp32, and so does this one: what a worker sends is its weights, not a
pseudo-gradient, so a codec's rounding error is a share of the weights, and the outer step it
spoils is a far smaller difference of them (issue 39, `python bench/codecs.py`, part 3: on
unit-scale weights that moved by 1e-3 of their size, the step comes out 21% wrong with fp16, 194%
with bf16, 746% with int8). Sending the pseudo-gradient theta - phi instead does not help: the
partner needs phi too (each worker has its own), which the authors' code sends beside it in fp32,
so any codec would cost more bytes than fp32 alone. So --compress takes fp32, or bf16 where the
weights are bf16 (--precision bf16): the same values in half the bytes; any other codec is refused.

The pairing (`pairing`) differs from the paper's. There every round pairs a random permutation of
all the workers: any two may meet. MLX's ring sends only between ring neighbours (and the launcher
orders the ring by link speed, so neighbours share the fastest links), so here a round draws an
offset o from a seed every worker shares and the round number, and pairs workers (o + 2i,
o + 2i + 1) mod M; with M odd, worker o - 1 sits out (it takes the step with its own weights as the
pair's mean). For M = 2 and 3 any two workers are ring neighbours; for larger M, a worker's
weights spread one ring hop per round instead of anywhere: the expected averaging's spectral gap
(how fast the workers' disagreement shrinks per round) is (1 - cos(2 pi / M)) / 2, against about 1/2
for random pairs: 0.5 against 0.67 for M = 4, 0.15 against 0.57 for M = 8, 0.04 against 0.53 for
M = 16. Large rings drift apart further between meetings than the paper's runs.

A run ends as the paper's do, with no extra exchange after its last outer step: with a step count
that H does not divide, the workers keep what their last inner steps made of their own weights.

The model evaluated and exported is worker 0's (the base class's): the workers never agree, the
run evaluates only in its reporting process (an all-mean there would wait on peers that never
call it), and the authors' code, too, evaluates each worker's own model (src/noloco/train.py,
get_eval_ppl: it reports their mean; here the metrics' eval_loss_workers). A worker that would send NaN or inf stops every worker of the job
(the exchange's check is all-gathered, comm.py), its partner and the others alike.
"""

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ..exchange.codecs import get_codec
from ..exchange.worker_axis import flatten_workers, unflatten
from .base import NO_INPUTS, Strategy, TickInputs, codec_label, option


def pairing(workers: int, seed: int, outer_step: int) -> list:
    """partner[w] at outer step `outer_step` (1, 2, ...): ring neighbours (o + 2i, o + 2i + 1) mod M from a random
    offset o; partner[w] == w for a worker that sits out (M odd, or M = 1)."""
    partner = list(range(workers))
    if workers < 2:
        return partner
    o = int(np.random.default_rng([seed, outer_step]).integers(workers))
    for i in range(workers // 2):
        a, b = (o + 2 * i) % workers, (o + 2 * i + 1) % workers
        partner[a], partner[b] = b, a
    return partner


@dataclass
class NoLoCo(Strategy):
    name = "noloco"
    worker_copies = 2  # each worker's outer weights and momentum (fp32)
    own_state = "outer weights and momentum"
    sync_every: int = option(50, "H: inner steps between outer steps")
    outer_lr: float = option(0.7, "outer learning rate, also the weight of the pull toward the pair's mean")
    outer_momentum: float = option(0.5, "outer momentum: heavy-ball (0: plain steps)")
    compress: str = option("fp32", "codec of the weights each worker sends its partner: fp32, or bf16 "
                                   "with bf16 weights (--precision bf16), both exact")
    pair_seed: int = option(0, "seed of the pairings (every worker draws the same ones)")

    def check(self):
        get_codec(self.compress)
        self.require(self.compress in ("fp32", "bf16"),
                     f"compress {self.compress} would round the weights themselves, an error no smaller than the "
                     "outer step (unit-scale weights that moved by 1e-3: the step 21% wrong with fp16, 746% with "
                     "int8); use --compress fp32, or bf16 with --precision bf16 (both exact)")
        self.require(self.sync_every >= 1, f"sync-every (H) must be >= 1 (got {self.sync_every})")
        self.require(self.outer_lr > 0, f"outer-lr must be > 0 (got {self.outer_lr})")
        self.require(0 <= self.outer_momentum < 1, f"outer-momentum must be in [0, 1) (got {self.outer_momentum})")


    def label_options(self) -> list:
        return super().label_options() + codec_label(self.compress)
    def pairing(self, outer_step: int) -> list:
        return pairing(self.comm.num_workers, self.pair_seed, outer_step)

    def setup(self, params):
        self.require(self.compress != "bf16" or all(v.dtype == mx.bfloat16 for _, v in tree_flatten(params)),
                     "compress bf16 would round fp32 weights to bf16, an error no smaller than the outer step "
                     "(unit-scale weights that moved by 1e-3: the step 194% wrong); use --precision bf16 (bf16 "
                     "weights: sent exactly) or --compress fp32")
        self.outer, _ = flatten_workers(self.comm.broadcast_local(params))  # (n_local, L) float32, a copy
        self.momentum = mx.zeros(self.outer.shape)
        mx.eval(self.outer, self.momentum)

    def after_step(self, params, step, tick: TickInputs = NO_INPUTS):
        if not self.schedule.syncs(step):
            return params
        dtypes = [(k, v.dtype) for k, v in tree_flatten(params)]
        weights, shapes = flatten_workers(params)
        del params  # the buffer holds the values now (Workers.take_params gave the only reference)
        partner = self.pairing(step // self.sync_every)
        mean = self.comm.start_pair_mean(weights, partner, self.compress, tag="pair mean").result()
        self.momentum = self.outer_momentum * self.momentum + self.outer_lr * (mean - self.outer)
        self.outer = self.outer + self.momentum
        mx.eval(self.momentum, self.outer)
        new = dict(tree_flatten(unflatten(self.outer, shapes)))
        return tree_unflatten([(k, new[k].astype(dtype)) for k, dtype in dtypes])

    def state(self):
        return {"outer": self.outer, "momentum": self.momentum}

    def load_state(self, state):
        self.outer, self.momentum = state["outer"], state["momentum"]
