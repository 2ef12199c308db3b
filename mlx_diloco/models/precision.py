"""What a model is stored and computed in: bf16 weights, and activation checkpointing per block.

bf16 halves the weights, gradients and stored activations. On Apple GPUs bf16 is also MLX's fast
path; MLX's CPU has no bf16 matrix multiply (measured here: 3 GFLOP/s against 98 for fp32), so on
the CPU the linear layers multiply in fp32 and round the result to bf16: the same memory (only
bf16 values are kept for the backward pass), fp32 speed. mlx-lm's attention gets the same
treatment (on the CPU only: it changes the module's function for every model of that architecture
in this process, and leaves fp32 inputs as they are).

Checkpointing keeps only each transformer block's input for the backward pass and recomputes the
rest (`mx.checkpoint`): activation memory of one block instead of all of them, for a second forward.
Inside `block_by_block()` a forward pass evaluates each block's output before it queues the next
block, which bounds what MLX allocates ahead (llama-1b: see README, Memory).
Both change a module's class in place (a subclass of its own), so parameter paths, checkpoints
and Streaming DiLoCo's fragments are unchanged.
"""

import sys
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn

from .zoo import BLOCK


@mx.custom_function
def matmul_fp32(x, w):
    """x @ w.T computed in fp32, returned in x's dtype; the backward pass keeps only x and w."""
    return (x.astype(mx.float32) @ w.astype(mx.float32).T).astype(x.dtype)


@matmul_fp32.vjp
def _matmul_fp32_vjp(primals, cotangent, output):
    x, w = primals
    g = cotangent.astype(mx.float32)
    dx = g @ w.astype(mx.float32)
    dw = g.reshape(-1, g.shape[-1]).T @ x.astype(mx.float32).reshape(-1, x.shape[-1])
    return dx.astype(x.dtype), dw.astype(w.dtype)


class Fp32MatmulLinear(nn.Linear):
    def __call__(self, x):
        y = matmul_fp32(x, self["weight"])
        return y + self["bias"] if "bias" in self else y


class Fp32MatmulEmbedding(nn.Embedding):
    def as_linear(self, x):  # a tied output head
        return matmul_fp32(x, self.weight)


def round_bf16_stochastically(x: mx.array) -> mx.array:
    """fp32 -> bf16, rounding up or down with probability given by the distance (unbiased): an
    update smaller than bf16's resolution still moves the weight on average. Rounded to nearest,
    those updates are lost: small GPT, DiLoCo, 500 steps, eval loss +1.1% against fp32 (README)."""
    noise = mx.random.randint(0, 1 << 16, x.shape, dtype=mx.uint32)
    return ((x.view(mx.uint32) + noise) & 0xFFFF0000).view(mx.float32).astype(mx.bfloat16)


def fp32_attention(attention):
    """mlx-lm's attention function, computing in fp32 what arrives in bf16 (the CPU's fast path)."""
    def attention_fp32(queries, keys, values, *args, **kwargs):
        if queries.dtype == mx.float32:
            return attention(queries, keys, values, *args, **kwargs)
        up = [a.astype(mx.float32) for a in (queries, keys, values)]
        return attention(*up, *args, **kwargs).astype(queries.dtype)
    attention_fp32.wrapped = attention
    return attention_fp32


def to_bf16(model: nn.Module) -> nn.Module:
    """Weights in bf16; on the CPU, linear layers and mlx-lm's attention multiply in fp32."""
    model.set_dtype(mx.bfloat16)
    if mx.default_device() != mx.cpu:
        return model
    for _, m in model.named_modules():
        if type(m) is nn.Linear:
            m.__class__ = Fp32MatmulLinear
        elif type(m) is nn.Embedding:
            m.__class__ = Fp32MatmulEmbedding
    # mlx-lm's architectures call scaled_dot_product_attention from their module's globals.
    module = sys.modules.get(type(model).__module__)
    attention = getattr(module, "scaled_dot_product_attention", None)
    if attention is not None and not hasattr(attention, "wrapped"):
        module.scaled_dot_product_attention = fp32_attention(attention)
    return model


_block_by_block = False


@contextmanager
def block_by_block():
    """Inside, a checkpointed block evaluates its output before the next block is queued (for
    forward passes outside vmap and compile). MLX's CPU allocates an operation's output when it
    queues it, so a bf16 forward pass otherwise holds every layer's fp32 weight copies at once
    (llama-1b: 3.9 GB)."""
    global _block_by_block
    before, _block_by_block = _block_by_block, True
    try:
        yield
    finally:
        _block_by_block = before


def checkpointed(cls):
    """`cls` with its __call__ run under mx.checkpoint: its activations recomputed in the backward pass."""
    def __call__(self, *args, **kwargs):
        def run(params, *args):
            self.update(params)
            return cls.__call__(self, *args, **kwargs)
        out = mx.checkpoint(run)(self.trainable_parameters(), *args)
        if _block_by_block:
            mx.eval(out)
        return out
    return type(f"Checkpointed{cls.__name__}", (cls,), {"__call__": __call__})


def checkpoint_blocks(model: nn.Module) -> int:
    """Checkpoint every transformer block of `model`; returns how many there are."""
    blocks = [m for path, m in model.named_modules() if (b := BLOCK.search(path)) and b.end() == len(path)]
    for m in blocks:
        m.__class__ = checkpointed(type(m))
    return len(blocks)
