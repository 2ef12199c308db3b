"""Distributed training strategies, written once against `comm.Communicator`.

Every worker takes the same inner steps (forward, backward, inner AdamW); a strategy decides
what is exchanged and when, through two hooks:

  reduce_gradients(grads, step)  before the inner optimizer's update (DDP averages here)
  after_step(params, step)       after it (DiLoCo's outer step happens here every H steps)

Parameters and gradients carry a leading local-worker axis (see comm.py). `step` is the
job-wide inner step counter, which every worker agrees on, so the sync schedule can never drift.
"""

import mlx.core as mx
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from .codecs import get_codec
from .comm import Communicator
from .fragments import Fragment, gather, global_tree, partition


class Strategy:
    name = "base"

    def __init__(self, comm: Communicator, config):
        self.comm, self.config = comm, config

    def setup(self, params):
        """Called once with the shared initial parameters (no worker axis)."""

    def reduce_gradients(self, grads, step: int):
        return grads

    def after_step(self, params, step: int):
        return params

    def global_params(self, params):
        """The model to evaluate and export (no worker axis)."""
        return tree_map(lambda p: p[0], params)

    def state(self) -> dict:
        return {}

    def load_state(self, state: dict):
        pass


class DDP(Strategy):
    """Data parallel: gradients averaged across workers at every step, so replicas stay equal."""
    name = "ddp"

    def reduce_gradients(self, grads, step):
        if self.comm.num_workers == 1:
            return grads
        mean = self.comm.all_mean(grads, self.config.compress, tag="gradients")
        return self.comm.broadcast_local(mean)


class DiLoCo(Strategy):
    """DiLoCo (arXiv 2311.08105) and Streaming DiLoCo (arXiv 2501.18512).

    Every H steps each fragment of the model takes an outer Nesterov step on the workers' mean
    pseudo-gradient  delta = global - local. With one fragment, no overlap and no merge this is
    DiLoCo; with P fragments their syncs are spread evenly over H (fragment p at offset
    H(p+1)/P mod H), each exchange is applied tau inner steps after it starts, and the result is
    merged into the local models with weight alpha on the local values."""
    name = "diloco"

    def outer_optimizer(self):
        c = self.config
        return optim.SGD(learning_rate=c.outer_lr, momentum=c.outer_momentum,
                         nesterov=c.outer_momentum > 0)

    def setup(self, params):
        c, P = self.config, self.config.fragments
        self.template = params
        flat = {k: v[None] for k, v in tree_flatten(params)}
        alpha = c.resolved_merge_alpha
        self.fragments = [
            Fragment(p, pieces, gather(flat, pieces)[0], self.outer_optimizer(), c.sync_every,
                     offset=c.sync_every * (p + 1) // P % c.sync_every, delay=c.overlap_steps, alpha=alpha,
                     codec=get_codec(c.compress), error_feedback=c.error_feedback, n_local=self.comm.n_local)
            for p, pieces in enumerate(partition(params, P, c.fragment_order))]

    def after_step(self, params, step):
        flat = dict(tree_flatten(params))
        if step == self.config.steps:  # the end: land what is in flight, then sync every fragment now
            for f in self.fragments:
                if f.pending is not None:
                    flat = f.perform_sync(flat)
                f.prepare_sync(flat, self.comm, step)
                flat = f.perform_sync(flat, final=True)
        else:
            for f in self.fragments:   # every worker starts the fragments' exchanges in the same order
                if f.is_send_step(step):
                    f.prepare_sync(flat, self.comm, step)
            for f in self.fragments:
                if f.pending is not None and f.apply_at == step:
                    flat = f.perform_sync(flat)
        return tree_unflatten(list(flat.items()))

    def global_params(self, params):
        return global_tree(self.template, self.fragments)

    def state(self):
        return {"global": self.global_params(None),
                "fragments": [f.state() for f in self.fragments]}

    def load_state(self, state):
        flat = {k: v[None] for k, v in tree_flatten(state["global"])}
        for f in self.fragments:
            f.global_values = gather(flat, f.pieces)[0]
            f.load_state(state["fragments"][f.index], self.comm)


class FedAvg(DiLoCo):
    """FedAvg / Local SGD: the global model becomes the workers' mean (outer lr 1, no momentum)."""
    name = "fedavg"

    def outer_optimizer(self):
        return optim.SGD(learning_rate=1.0)


STRATEGIES = {cls.name: cls for cls in (DDP, DiLoCo, FedAvg)}


def make_strategy(comm, config) -> Strategy:
    return STRATEGIES[config.strategy](comm, config)
