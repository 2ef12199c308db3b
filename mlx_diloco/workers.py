"""The model replicas one process trains.

Parameters are stacked on a leading worker axis; one `mx.vmap`-ed step computes every
replica's loss and gradients at once, and the inner AdamW (elementwise) updates them all.
Anything that couples parameters, like global-norm clipping, is computed per replica.
"""

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_map

from .comm import stack_copies


def clip_per_worker(grads, max_norm: float):
    """Global-norm clipping, each replica on its own (grads carry the worker axis)."""
    # Summed in sorted path order: a tree read back from a checkpoint has its keys in another
    # order, and float addition order must not depend on where the tree came from.
    leaves = [g for _, g in sorted(tree_flatten(grads), key=lambda kv: kv[0])]
    sq = sum(mx.sum(mx.square(g.reshape(g.shape[0], -1)), axis=1) for g in leaves)
    scale = mx.minimum(1.0, max_norm / (mx.sqrt(sq) + 1e-6))
    return tree_map(lambda g: g * scale.reshape((-1,) + (1,) * (g.ndim - 1)).astype(g.dtype), grads)


class Workers:
    def __init__(self, model: nn.Module, n_local: int, config, optimizer: optim.Optimizer, clip: bool = True,
                 vectorize: bool = True):
        self.model, self.config, self.n_local = model, config, n_local
        self.clip = clip and config.grad_clip > 0
        self.params = stack_copies(model.trainable_parameters(), n_local)
        self.optimizer = optimizer
        self.optimizer.init(self.params)
        grad_fn = mx.value_and_grad(self.loss)
        self._grads = mx.vmap(grad_fn) if vectorize else self._sequential(grad_fn)
        self._eval_each = mx.vmap(self.loss, in_axes=(0, None, None))
        # One fused kernel per parameter instead of ~15 elementwise passes: the N-fold
        # optimizer work is most of what simulating N workers costs over one big batch.
        self._update = mx.compile(self._clip_and_update)

    def loss(self, params, x, y):
        self.model.update(params)
        logits = self.model(x)
        return nn.losses.cross_entropy(logits.astype(mx.float32), y, reduction="mean")

    def _sequential(self, grad_fn):
        """The same computation without vmap: one replica after another."""
        def run(params, x, y):
            outs = [grad_fn(tree_map(lambda p: p[i], params), x[i], y[i]) for i in range(self.n_local)]
            losses = mx.stack([loss for loss, _ in outs])
            grads = tree_map(lambda *gs: mx.stack(gs), *[g for _, g in outs])
            return losses, grads
        return run

    def _clip_and_update(self, params, grads, state):
        """Pure function of its inputs (for mx.compile): the optimizer state goes in and out."""
        self.optimizer.state = state
        if self.clip:
            grads = clip_per_worker(grads, self.config.grad_clip)
        params = self.optimizer.apply_gradients(grads, params)
        return params, self.optimizer.state

    def step(self, x, y, strategy, step: int) -> mx.array:
        """One inner step of every local replica; `step` is the job-wide step number (1-based).
        The strategy's after_step (the outer step) is left to the caller."""
        losses, grads = self._grads(self.params, x, y)
        grads = strategy.reduce_gradients(grads, step)
        self.params, self.optimizer.state = self._update(self.params, grads, self.optimizer.state)
        mx.eval(self.params, self.optimizer.state, losses)
        return losses

    def eval_each(self, batches) -> mx.array:
        """Validation loss of every local replica, shape (n_local,)."""
        total = sum(self._eval_each(self.params, mx.array(x), mx.array(y)) for x, y in batches)
        return total / len(batches)

    def eval_params(self, params, batches) -> float:
        total = sum(self.loss(params, mx.array(x), mx.array(y)) for x, y in batches)
        return (total / len(batches)).item()
