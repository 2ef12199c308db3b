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
from mlx.utils import tree_map

from .comm import Communicator


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

    def is_sync_step(self, step: int) -> bool:
        """True where every worker holds the same model (a safe checkpoint boundary)."""
        return True

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
        mean = self.comm.all_mean(grads, self.config.comm_dtype)
        return self.comm.broadcast_local(mean)


class DiLoCo(Strategy):
    """DiLoCo (arXiv 2311.08105): H local steps, then an outer Nesterov step on the averaged
    pseudo-gradient  delta = global - local."""
    name = "diloco"

    def outer_optimizer(self):
        c = self.config
        return optim.SGD(learning_rate=c.outer_lr, momentum=c.outer_momentum,
                         nesterov=c.outer_momentum > 0)

    def setup(self, params):
        self.global_model = params
        self.outer = self.outer_optimizer()
        self.outer.init(self.global_model)

    def is_sync_step(self, step):
        """Every H steps, and at the last step: a run always ends on a synced global model."""
        return step % self.config.sync_every == 0 or step == self.config.steps

    def after_step(self, params, step):
        if not self.is_sync_step(step):
            return params
        delta = tree_map(lambda g, p: g[None] - p, self.global_model, params)
        mean_delta = self.comm.all_mean(delta, self.config.comm_dtype)
        self.global_model = self.outer.apply_gradients(mean_delta, self.global_model)
        mx.eval(self.global_model, self.outer.state)
        return self.comm.broadcast_local(self.global_model)

    def global_params(self, params):
        return self.global_model

    def state(self):
        return {"global": self.global_model, "outer": self.outer.state}

    def load_state(self, state):
        self.global_model = state["global"]
        self.outer.state = state["outer"]


class FedAvg(DiLoCo):
    """FedAvg / Local SGD: the global model becomes the workers' mean (outer lr 1, no momentum)."""
    name = "fedavg"

    def outer_optimizer(self):
        return optim.SGD(learning_rate=1.0)


STRATEGIES = {cls.name: cls for cls in (DDP, DiLoCo, FedAvg)}


def make_strategy(comm, config) -> Strategy:
    return STRATEGIES[config.strategy](comm, config)
