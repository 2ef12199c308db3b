"""Activation checkpointing per transformer block, and passes that run one block at a time.

A checkpointed block keeps only its input for the backward pass and recomputes the rest: the
activation memory of one block instead of all of them, for a second forward pass.

MLX's CPU allocates an operation's output when it queues the operation, not when it runs it, so a
pass evaluated as one graph holds many of its intermediates at once, however short-lived (in
bf16, the layers' fp32 weight copies; in the backward pass, the blocks' fp32 weight gradients too;
docs/memory.md). The passes here are cut at the blocks and each piece is evaluated before the next
is queued:
- `block_by_block()`: a forward pass evaluates each block's output before the next block.
- `blockwise_value_and_grad`: the loss and gradients as `mx.value_and_grad` computes them, in
  pieces: a forward pass that keeps each block's input; the head (everything after the last block)
  differentiated on its own; then each block's vector-Jacobian product, from the last block down;
  then the embeddings (everything before the first block). Each piece is one small graph.

Checkpointing changes a module's class in place (a subclass of its own), so parameter paths,
checkpoints and Streaming DiLoCo's fragments are unchanged.
"""

from contextlib import contextmanager
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from .zoo import BLOCK

_pass = None  # what a checkpointed block's call does now: None (an ordinary call) or one of the passes below


@contextmanager
def _running(p):
    global _pass
    before, _pass = _pass, p
    try:
        yield p
    finally:
        _pass = before


class Forward:
    """Evaluate each block's output before the next block is queued."""

    def block(self, module, call, x, args, kwargs):
        out = call(module, x, *args, **kwargs)
        mx.eval(out)
        return out


def block_by_block():
    """Inside, a forward pass (outside vmap and compile) goes one block at a time."""
    return _running(Forward())


@dataclass
class BlockCall:
    module: nn.Module
    call: object     # the block's own __call__ (not checkpointed)
    input: mx.array
    args: tuple      # the other arguments (a mask, a cache), passed as they were
    kwargs: dict
    output: mx.array


class Record(Forward):
    """The forward pass of `blockwise_value_and_grad`: every block call, its input and output kept.
    `chained` says whether the blocks ran as a chain (each block once, each one's input the
    previous one's output): what the pieces rely on."""

    def __init__(self):
        self.calls, self.chained = [], True

    def block(self, module, call, x, args, kwargs):
        if self.calls and (x is not self.calls[-1].output or any(c.module is module for c in self.calls)):
            self.chained = False
        out = super().block(module, call, x, args, kwargs)
        self.calls.append(BlockCall(module, call, x, args, kwargs, out))
        return out


class Head:
    """The blocks give back their recorded outputs, the last one `last` (what is differentiated)."""

    def __init__(self, outputs: list, last: mx.array):
        self.outputs, self.last, self.i = outputs, last, 0

    def block(self, module, call, x, args, kwargs):
        self.i += 1
        return self.last if self.i == len(self.outputs) else self.outputs[self.i - 1]


class _FirstBlockInput(Exception):
    def __init__(self, value):
        super().__init__("the first block's input")
        self.value = value


class Embeddings:
    """The forward pass stops at the first block, handing back its input."""

    def block(self, module, call, x, args, kwargs):
        raise _FirstBlockInput(x)


def checkpointed(cls):
    """`cls` with its __call__ run under mx.checkpoint, or as the pass in progress says."""
    def __call__(self, x, *args, **kwargs):
        if _pass is not None:
            return _pass.block(self, cls.__call__, x, args, kwargs)

        def run(params, x, *args):
            self.update(params)
            return cls.__call__(self, x, *args, **kwargs)
        return mx.checkpoint(run)(self.trainable_parameters(), x, *args)
    return type(f"Checkpointed{cls.__name__}", (cls,), {"__call__": __call__})


def checkpoint_blocks(model: nn.Module) -> int:
    """Checkpoint every transformer block of `model`; returns how many there are."""
    blocks = [m for path, m in model.named_modules() if (b := BLOCK.search(path)) and b.end() == len(path)]
    for m in blocks:
        m.__class__ = checkpointed(type(m))
    return len(blocks)


def _vjp(fn, primals: dict, cotangent: mx.array):
    """fn's vector-Jacobian product for a dict of named arrays (mx.vjp takes a list)."""
    names = list(primals)
    _, grads = mx.vjp(lambda *values: fn(dict(zip(names, values))), [primals[k] for k in names], [cotangent])
    return dict(zip(names, grads))


def blockwise_value_and_grad(model: nn.Module, loss_fn):
    """`(params, x, y) -> (loss, grads)`, as `mx.value_and_grad` of `loss_fn(model, x, y)` gives
    them, for a model with checkpointed blocks, computed and evaluated a piece at a time (above).
    The loss must reach the blocks' parameters through the model's forward pass only (the default
    cross-entropy does). A model whose blocks do not run as a chain gets the ordinary backward."""
    prefix = {id(m): path + "." for path, m in model.named_modules()}

    def ordinary(params, x, y):
        model.update(params)
        return loss_fn(model, x, y)
    ordinary_grad = mx.value_and_grad(ordinary)

    def value_and_grad(params, x, y):
        model.update(params)
        with _running(Record()) as record:
            loss_fn(model, x, y)  # evaluates the blocks; the head's part stays unevaluated and is dropped
        if not record.chained or not record.calls:
            return ordinary_grad(params, x, y)
        calls, flat = record.calls, dict(tree_flatten(params))
        in_blocks = tuple(prefix[id(c.module)] for c in calls)
        outside = {k: v for k, v in flat.items() if not k.startswith(in_blocks)}

        def head(values):
            model.update(tree_unflatten(list(values["outside"].items())))
            with _running(Head([c.output for c in calls], values["last"])):
                return loss_fn(model, x, y)
        loss, g = mx.value_and_grad(head)({"outside": outside, "last": calls[-1].output})
        grads, cotangent = g["outside"], g["last"]
        mx.eval(loss, grads, cotangent)

        for c in reversed(calls):  # each block's gradients, and its input's, from the last block down
            p = prefix[id(c.module)]
            block_params = {k: v for k, v in flat.items() if k.startswith(p)}

            def block(values, c=c, p=p):
                c.module.update(tree_unflatten([(k[len(p):], v) for k, v in values.items() if k != "input"]))
                return c.call(c.module, values["input"], *c.args, **c.kwargs)
            g = _vjp(block, {**block_params, "input": c.input}, cotangent)
            cotangent = g.pop("input")
            grads.update(g)
            mx.eval(cotangent, g)

        def embeddings(values):
            model.update(tree_unflatten(list(values.items())))
            try:
                with _running(Embeddings()):
                    loss_fn(model, x, y)
            except _FirstBlockInput as e:
                return e.value
            raise RuntimeError("the model's forward pass did not reach its first block")
        if outside:
            for k, g in _vjp(embeddings, outside, cotangent).items():
                grads[k] = grads[k] + g
            mx.eval(grads)
        return loss, tree_unflatten(list(grads.items()))
    return value_and_grad
