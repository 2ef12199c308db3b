"""The model replicas one process trains.

Parameters are stacked on a leading worker axis, and so are the batches: inputs x and targets y, an
array or a tree of them (a post-training objective's batch: objectives/). Several replicas step at
once through `mx.vmap`:
the gradients of the vmapped losses' sum are each replica's own, and MLX's fused kernels fold the
replica axis into the batch axis (models/kernels.py); one replica steps without vmap, as a plain
MLX script does. The inner AdamW (elementwise) updates them all; anything that couples
parameters, like global-norm clipping, is computed per replica.

The inner step is `mx.compile`d: traced once, then replayed with its elementwise chains fused
(MLX's guidance: a pure function of its inputs; the optimizer state and the random state go in
and out). Forward, backward, clipping and update are one compiled function, evaluated at once,
whenever memory allows (`fits_whole_step`: measured at the first step). What stays outside, and why:
- a strategy's reduce_gradients that changes the gradients (DDP's mean is a collective, which
  cannot run inside a graph): the compiled gradients go to it, and its result to the compiled update;
- an update that would not fit beside the step's activations: the gradients are evaluated first,
  then the update a group of parameters at a time (UPDATE_GROUP);
- checkpointed models' passes (models/checkpointing.py), which evaluate block by block.
"""

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_map, tree_map_with_path, tree_unflatten

from ..config import ConfigError
from ..data.jsonl import IGNORE
from ..exchange.worker_axis import placeholders, replica, stack_copies
from ..models.kernels import replica_axis, token_cross_entropy
from ..models.checkpointing import block_by_block, blockwise_value_and_grad


# Elements (over every local replica) whose inner update is evaluated together when the whole update
# does not fit at once. MLX's CPU allocates an operation's output when it is queued, so evaluating a
# whole model's update at once holds its old and new weights and moments, plus every temporary, at
# the same time (llama-150m, bf16: the update's peak 3.41 GB, 2.57 in groups; bench/memory_phases.py).
UPDATE_GROUP = 1 << 24
# The share of MLX's memory limit that the whole compiled step may take (the rest: what the run
# holds beside the step, the evaluation, the allocator's rounding).
WHOLE_STEP_SHARE = 0.9


def sorted_leaves(*trees) -> list:
    """The leaves of `trees` in sorted path order (a tree read back from a checkpoint has its keys in
    another order, and float sums must not depend on that); leaves at the same path sit together (a
    parameter and its AdamW moments)."""
    leaves = sorted(((path, i, leaf) for i, tree in enumerate(trees) for path, leaf in tree_flatten(tree)),
                    key=lambda e: e[:2])
    return [leaf for _, _, leaf in leaves]


def in_groups(*trees, size: int = UPDATE_GROUP):
    """The leaves of `trees` (sorted_leaves) in groups of about `size` elements."""
    group, n = [], 0
    for leaf in sorted_leaves(*trees):
        if group and n + leaf.size > size:
            yield group
            group, n = [], 0
        group.append(leaf)
        n += leaf.size
    if group:
        yield group


def clip_scale(grads, max_norm: float, size: int = UPDATE_GROUP) -> mx.array:
    """Global-norm clipping's factor for each replica (grads carry the worker axis), shape (n,);
    evaluated group by group, so the squares never exist all at once."""
    sq = 0
    for group in in_groups(grads, size=size):
        sq = squared_norms(group, sq)
        mx.eval(sq)
    return clip_factor(sq, max_norm)


def squared_norms(leaves, sq=0, streams=None) -> mx.array:
    """`sq` plus each replica's sum of squares over `leaves` (each with the worker axis first), added
    in their order; each leaf's own sum on one of `streams` (`spread`: by size)."""
    sums = [mx.sum(mx.square(g.reshape(g.shape[0], -1)), axis=1, stream=s)
            for g, s in zip(leaves, spread(leaves, streams or [None]))]
    for part in sums:
        sq = sq + part
    return sq


def spread(arrays, streams) -> list:
    """A stream for each array, the least loaded (in elements) so far: the same for the same sizes."""
    load, chosen = [0] * len(streams), []
    for a in arrays:
        i = load.index(min(load))
        load[i] += a.size
        chosen.append(streams[i])
    return chosen


def clip_factor(sq: mx.array, max_norm: float) -> mx.array:
    return mx.minimum(1.0, max_norm / (mx.sqrt(sq) + 1e-6))


def cpu_threads() -> int:
    """The threads this process may compute on: its BLAS threads where they are set (sim's processes
    share the cores: training/processes.py), else its cores."""
    import os
    set_to = os.environ.get("OPENBLAS_NUM_THREADS", "")
    return int(set_to) if set_to.isdigit() and int(set_to) > 0 else len(os.sched_getaffinity(0)) \
        if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class UpdateStreams:
    """The optimizer's per-parameter updates, each with its gradient's clipping, spread by size over
    one MLX stream per thread on the CPU: MLX's CPU runs an elementwise kernel on one thread, and the
    update, a few passes over N replicas' weights, gradients and moments, would leave the other cores
    idle after the backward pass (BLAS's matmuls use them all). Each stream has its thread, and MLX
    orders the streams' work by its dependencies; a parameter's clipping and update share its stream
    (MLX fuses no kernel across streams). One stream (the default) on a GPU or a single thread."""

    def __init__(self, threads: int = None):
        threads = cpu_threads() if threads is None else threads
        if mx.default_device() != mx.cpu:
            threads = 1
        self.streams = [mx.default_stream(mx.default_device())] + [mx.new_stream(mx.cpu) for _ in range(threads - 1)]
        self.scale, self.chosen = None, iter(())

    def apply(self, optimizer, grads, params, scale=None):
        """`optimizer`'s update of `params` by `grads`, each replica's gradients times its `scale`
        (shape (n,); None: not clipped). The optimizer is an argument: whoever holds it may swap it."""
        for o in getattr(optimizer, "optimizers", [optimizer]):  # a MultiOptimizer's parts
            if not hasattr(o, "_apply_single_on_one_stream"):
                o._apply_single_on_one_stream = o.apply_single
                o.apply_single = self._on_a_stream(o._apply_single_on_one_stream)
        # the optimizer visits the parameters in the order of their tree, as tree_flatten lists them
        self.scale, self.chosen = scale, iter(spread([p for _, p in tree_flatten(params)], self.streams))
        try:
            return optimizer.apply_gradients(grads, params)
        finally:  # (inside mx.compile they are the trace's: none may outlive it)
            self.scale, self.chosen = None, iter(())

    def squared_norms(self, leaves) -> mx.array:
        """Each replica's sum of squares over `leaves`, the leaves' sums spread over the streams."""
        return squared_norms(leaves, streams=self.streams)

    def _on_a_stream(self, apply_single):
        def applied(gradient, parameter, state):
            with mx.stream(next(self.chosen, self.streams[0])):
                if self.scale is not None:
                    gradient = gradient * self.scale.reshape((-1,) + (1,) * (gradient.ndim - 1)).astype(gradient.dtype)
                return apply_single(gradient, parameter, state)
        return applied


def row(y, i: int):
    """Worker i's targets: `y` is an array, or a tree of them (an objective's: objectives/), with the
    worker axis first."""
    return tree_map(lambda a: a[i], y)


def cross_entropy(model, x, y):
    """The default loss: mean cross-entropy of the model's logits (language models, classifiers)."""
    return token_cross_entropy(model(x), y).mean()


def masked_cross_entropy(model, x, y):
    """The loss of masked data (JSONL: data/jsonl.py): the mean cross-entropy over the targets that are
    not IGNORE (padding, and prompts under mask-prompt), as mlx-lm's default_loss."""
    trained = y != IGNORE
    ce = token_cross_entropy(model(x), mx.where(trained, y, 0)) * trained
    return ce.sum() / mx.maximum(trained.sum(), 1)


def check_loss(loss_fn, model, x, y):
    """A loss function given by the user, tried on one batch: it must return one float (a scalar
    mx.array), which the gradient is taken of; else a ConfigError saying what it returned."""
    value = loss_fn(model, mx.array(x), tree_map(mx.array, y))
    if isinstance(value, mx.array) and value.ndim == 0 and mx.issubdtype(value.dtype, mx.floating):
        return
    if isinstance(value, mx.array) and value.ndim:
        got = f"an array of shape {tuple(value.shape)}"
    elif isinstance(value, mx.array):
        got = f"an {str(value.dtype).split('.')[-1]} scalar"
    else:
        got = f"{type(value).__name__} {str(value)[:40]}"
    name = getattr(loss_fn, "__name__", "loss_fn")
    raise ConfigError(f"loss function '{name}' returned {got}, not a float scalar; return the batch's mean loss "
                      "as an mx.array, e.g. nn.losses.cross_entropy(model(x), y, reduction=\"mean\")")


class Workers:
    """`vectorize`: True (vmap), False (one replica after another) or "auto" (vmap, unless the
    model's first step shows that MLX cannot vmap it: then say so once and go one by one).
    `masked`: the data's targets are masked (IGNORE), and the default loss leaves those out."""
    update_group = UPDATE_GROUP
    whole_step = None  # the whole step compiled as one (None: decided at the first step, fits_whole_step)

    def __init__(self, model: nn.Module, n_local: int, config, optimizer: optim.Optimizer, clip: bool = True,
                 vectorize=True, loss=None, masked=False, log=print):
        self.model, self.config, self.n_local, self.log = model, config, n_local, log
        self.loss_fn = loss or (masked_cross_entropy if masked else cross_entropy)
        self.clip = clip and config.grad_clip > 0
        self.params = stack_copies(model.trainable_parameters(), n_local)
        # Unevaluated zeros of the model's shape: what the model holds between uses (see release).
        self._placeholders = placeholders(model.trainable_parameters())
        self.optimizer = optimizer
        self.optimizer.init(self.params)
        # A checkpointed model's passes evaluate a block at a time (models/checkpointing.py): an
        # evaluation cannot happen inside a compiled function, so they run op by op.
        self.checkpointed = config.grad_checkpoint and loss is None
        if self.checkpointed:
            self._grad_fn = blockwise_value_and_grad(model, self.loss_fn)
        else:
            self._grad_fn = mx.value_and_grad(self.loss)
        if vectorize and not self.checkpointed:
            self._use(self._vectorized, self._eval_vectorized)
        elif vectorize:
            self._use(mx.vmap(self._grad_fn), self._eval_vectorized)
        else:
            self._use(self._sequential(self._grad_fn), self._eval_one_by_one)
        self._probe = vectorize == "auto"
        # One fused kernel per parameter instead of ~15 elementwise passes: the N-fold
        # optimizer work is most of what simulating N workers costs over one big batch.
        # The random state goes in and out: bf16 updates round stochastically (strategies/base.py).
        self.update_streams = UpdateStreams()
        self._update = mx.compile(self._clip_and_update, inputs=[mx.random.state], outputs=[mx.random.state])
        self._masked_update = mx.compile(self._clip_and_update_some, inputs=[mx.random.state],
                                         outputs=[mx.random.state])
        self.n_elements = n_local * sum(p.size for _, p in tree_flatten(self._placeholders))

    def _use(self, grads, eval_each):
        """Train with `grads` (vmapped or one replica after another): compiled, and inside the
        compiled whole step, unless the model is checkpointed."""
        self._grads, self._eval_each = grads, eval_each
        # The random state goes in and out, as in the whole step: else a dropout mask drawn in the
        # first trace would be replayed at every step.
        self._compiled_grads = grads if self.checkpointed else mx.compile(
            grads, inputs=[mx.random.state], outputs=[mx.random.state])
        self._whole_step = None if self.checkpointed else mx.compile(
            self._clip_and_update_step, inputs=[mx.random.state], outputs=[mx.random.state])

    def loss(self, params, x, y):
        self.model.update(params)
        return self.loss_fn(self.model, x, y)

    def _vectorized(self, params, x, y):
        """Every replica's loss and gradients: without vmap for one replica; for several, the
        gradients of the sum of the vmapped losses (each replica's own: the replicas do not mix),
        traced with the fused kernels folding the replica axis into the batch (models/kernels.py)."""
        if self.n_local == 1:
            loss, grads = self._grad_fn(replica(params), x[0], row(y, 0))
            return loss[None], tree_map(lambda g: g[None], grads)

        def total(params, x, y):
            with replica_axis():
                losses = mx.vmap(self.loss)(params, x, y)
            return losses.sum(), losses
        (_, losses), grads = mx.value_and_grad(total)(params, x, y)
        return losses, grads

    def _eval_vectorized(self, params, x, y):
        if self.n_local == 1:
            return self.loss(replica(params), x, y)[None]
        with replica_axis():
            return mx.vmap(self.loss, in_axes=(0, None, None))(params, x, y)

    def _sequential(self, grad_fn):
        """The same computation without vmap: one replica after another."""
        def run(params, x, y):
            outs = [grad_fn(replica(params, i), x[i], row(y, i)) for i in range(self.n_local)]
            losses = mx.stack([loss for loss, _ in outs])
            grads = tree_map(lambda *gs: mx.stack(gs) if len(gs) > 1 else gs[0][None], *[g for _, g in outs])
            return losses, grads
        return run

    def _eval_one_by_one(self, params, x, y):
        with block_by_block():
            return mx.stack([self.loss(replica(params, i), x, y) for i in range(self.n_local)])

    def take_params(self):
        """The parameters, handed over: with no reference left here, whoever replaces them (the
        outer step) can free each old array as its new one is made, not a whole model at the end."""
        params, self.params = self.params, None
        return params

    def release(self):
        """Point the model at placeholders: after a call it holds the arrays it last ran with,
        which would keep a stale copy of the parameters alive (measured: 4 bytes/parameter, twice
        with checkpointed blocks)."""
        self.model.update(self._placeholders)

    def _gradients(self, x, y):
        out = self._gradients_once(x, y)
        mx.eval(out)
        self.release()
        return out

    def _gradients_once(self, x, y):
        if not self._probe:
            return self._compiled_grads(self.params, x, y)
        self._probe = False
        try:  # op by op: a compiled trace that raised would leave its placeholder in MLX's random
            out = self._grads(self.params, x, y)  # state, and whatever is drawn next could not be evaluated
            mx.eval(out)
            return out
        except (ValueError, RuntimeError) as e:  # e.g. "not implemented for AsStrided" (conv2d's gradient)
            self.log(f"this model cannot be vmapped in MLX ({str(e).splitlines()[0][:80]}); "
                     "training its replicas one after another")
            self._use(self._sequential(self._grad_fn), self._eval_one_by_one)
            return self._compiled_grads(self.params, x, y)

    def describe(self) -> str:
        """How the step runs (the run's summary says it)."""
        if self.checkpointed:
            return "checkpointed blocks, op by op"
        how = {True: "compiled whole step", False: f"update in groups of {self.update_group:,} elements (memory)",
               None: "not stepped yet"}[self.whole_step]
        replicas = "vmapped replicas" if self._grads == self._vectorized and self.n_local > 1 else (
            "one replica" if self.n_local == 1 else "replicas one after another")
        return f"{replicas}, {how}"

    def fits_whole_step(self, backward_peak: int) -> bool:
        """Whether the whole compiled step fits in MLX's memory limit: beside what the backward pass
        took at its peak (measured), it holds a second copy of the parameters and optimizer state,
        the update's new values, until the old ones are released."""
        update_bytes = sum(a.nbytes for _, a in tree_flatten((self.params, self.optimizer.state)))
        return backward_peak + update_bytes <= WHOLE_STEP_SHARE * mx.get_memory_limit()

    def _clip_and_update(self, params, grads, state, scale):
        """Pure function of its inputs (for mx.compile): the optimizer state goes in and out."""
        self.optimizer.state = state
        params = self.update_streams.apply(self.optimizer, grads, params, scale if self.clip else None)
        return params, self.optimizer.state

    def _clip_and_update_step(self, params, state, x, y):
        """The whole inner step, a pure function of its inputs (for mx.compile): the losses, the
        gradients (for the strategy's hook) and the clipped update's parameters and state."""
        losses, grads = self._grads(params, x, y)
        scale = clip_factor(self.update_streams.squared_norms(sorted_leaves(grads)), self.config.grad_clip) \
            if self.clip else None
        return losses, grads, self._clip_and_update(params, grads, state, scale)

    def _clip_and_update_some(self, params, grads, state, scale, active):
        """The update for the replicas where `active` (n_local,) is true; the others keep their
        parameters and moments (workers slower than the tick: speeds.py)."""
        old_state = tree_map(lambda x: x, state)  # a copy of the tree: the optimizer updates its state in place
        new_params, new_state = self._clip_and_update(params, grads, state, scale)

        def pick(new, old):
            if new.ndim == 0:  # the step count and learning rate: shared by the replicas
                return new
            return mx.where(active.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)
        return tree_map(pick, new_params, params), tree_map(pick, new_state, old_state)

    def _step_whole(self, x, y, strategy, step: int):
        """The compiled whole step: (losses, None) when done; (losses, gradients) evaluated, when the
        strategy's hook changed them (DDP's mean) and the update must be redone with them."""
        state = self.optimizer.state  # (a trace leaves the optimizer holding the trace's arrays)
        losses, grads, new = self._whole_step(self.params, state, x, y)
        reduced = strategy.reduce_gradients(grads, step)
        if reduced is grads:  # left alone: the update already in the graph is the step's
            self.params, self.optimizer.state = new
            mx.eval(losses, new)
            self.release()
            return losses, None
        # The graph's update is dropped unevaluated (the random state has moved past its draws).
        self.optimizer.state = state
        del new
        mx.eval(losses, reduced)
        self.release()
        return losses, reduced

    def count_tick(self):
        """A tick at which none of this process's replicas steps (they are slower: speeds.py) still
        counts in the optimizer's step, so that its learning-rate schedule and bias correction follow
        ticks, as in the simulator, where one optimizer steps the stacked replicas at every tick."""
        for o in getattr(self.optimizer, "optimizers", [self.optimizer]):  # a MultiOptimizer's parts count their own
            o.state["step"] = o.step + 1

    def step(self, x, y, strategy, step: int, active=None) -> mx.array:
        """One inner step of every local replica (of those `active` marks, if given); `step` is
        the job-wide step number (1-based). The strategy's after_step (the outer step) is left
        to the caller."""
        # The whole step at once when it fits (decided at the first step, which measures the backward
        # pass); else the gradients are evaluated first, and the update a group at a time.
        if self.whole_step and not self.checkpointed and not self._probe and active is None:
            losses, grads = self._step_whole(x, y, strategy, step)
            if grads is None:
                return losses
        else:
            losses, grads = self._gradients(x, y)  # evaluated: the activations are gone before the update
            if self.whole_step is None and not self.checkpointed:
                self.whole_step = self.fits_whole_step(mx.get_peak_memory())
            grads = strategy.reduce_gradients(grads, step)
        scale = clip_scale(grads, self.config.grad_clip, self.update_group) if self.clip else mx.ones(self.n_local)
        if active is None:
            new = self._update(self.params, grads, self.optimizer.state, scale)
        else:
            new = self._masked_update(self.params, grads, self.optimizer.state, scale, mx.array(active))
        # Only the lazy update holds the old values now: evaluated a group at a time, each group's
        # old weights, moments and gradients are freed before the next group's new ones exist.
        self.params, self.optimizer.state = new
        del grads, new
        for group in in_groups(self.params, self.optimizer.state, size=self.update_group):
            mx.eval(group)
        return losses

    def admit(self, joining: list, params, inner_state: dict):
        """Replicas that join the job mid-run (`joining`: one bool per local replica) take `params`, the
        global model (no worker axis), and `inner_state`, a member's per-replica optimizer state
        ({path: value without the worker axis}): its moments, not fresh zeros, which the shared step
        count's bias correction would make several times too large."""
        rows = mx.array(joining)

        def put(old, new):
            return mx.where(rows.reshape((-1,) + (1,) * (old.ndim - 1)), new.astype(old.dtype)[None], old)
        # By path: a model's tree may hold what no global model carries (mlx-lm's llama: layer_types, a list of names).
        given = dict(tree_flatten(params))
        self.params = tree_map_with_path(lambda path, old: put(old, given[path]), self.params)
        state = tree_flatten(self.optimizer.state)
        self.optimizer.state = tree_unflatten([(k, put(v, inner_state[k]) if k in inner_state else v)
                                               for k, v in state])
        mx.eval(self.params, self.optimizer.state)

    def eval_each(self, batches) -> mx.array:
        """Validation loss of every local replica, shape (n_local,)."""
        out = self._mean_loss(lambda x, y: self._eval_each(self.params, x, y), batches)
        self.release()
        return out

    def eval_params(self, params, batches) -> float:
        with block_by_block():
            out = self._mean_loss(lambda x, y: self.loss(params, x, y), batches).item()
        self.release()
        return out

    @staticmethod
    def _mean_loss(loss, batches) -> mx.array:
        """The mean of `loss` over the batches' examples (each batch's mean weighted by its examples:
        the same for any batch size), evaluated batch by batch (one batch's logits at a time)."""
        total, examples = 0, 0
        for x, y in batches:
            total = total + loss(mx.array(x), tree_map(mx.array, y)) * len(x)
            examples += len(x)
            mx.eval(total)
        return total / examples
