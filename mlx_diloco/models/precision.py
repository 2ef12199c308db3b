"""What a model is stored and computed in: bf16 weights, fp32 matrix multiplies on the CPU.

bf16 halves the weights, gradients and stored activations. On Apple GPUs bf16 is also MLX's fast
path; MLX's CPU has no bf16 matrix multiply (measured here: 3 GFLOP/s against 98 for fp32), so on
the CPU the linear layers multiply in fp32 and round the result to bf16: the same memory (only
bf16 values are kept for the backward pass), fp32 speed. mlx-lm's attention gets the same
treatment (on the CPU only: it changes the module's function for every model of that architecture
in this process, and leaves fp32 inputs as they are).
"""

import sys
from functools import lru_cache

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .kernels import paths


def widened(w: mx.array) -> mx.array:
    """w in fp32 for the backward pass. A bf16 w is widened by its bits (the same values as
    astype): compile would merge an astype with the forward pass's identical one and keep an fp32
    copy of every weight from the forward pass to the backward (bench/memory.py, llama-1b LoRA in
    bf16, 2 x 256 tokens: a 6.75 GB peak, 4.65 GB widened by bits)."""
    if w.dtype != mx.bfloat16:
        return w.astype(mx.float32)
    return (w.view(mx.uint16).astype(mx.uint32) << 16).view(mx.float32)


def _matmul_in_fp32(out_fp32: bool):
    """x @ w.T computed in fp32, returned in fp32 or in x's dtype; the backward pass keeps only
    x and w (in their own dtype) and returns gradients in their dtypes. w: (D, C), or replicas'
    own weights (n, D, C) with x (n, ..., C), which is what vmapping it over replicas calls."""
    @mx.custom_function
    def matmul(x, w):
        y = _times_transposed(x.astype(mx.float32), w.astype(mx.float32))
        return y if out_fp32 else y.astype(x.dtype)

    @matmul.vjp
    def matmul_vjp(primals, cotangent, output):
        x, w = primals
        # Two casts of the cotangent, by different ops: one merged cast would keep an fp32 copy
        # of it alive from dx's matmul until dw's, which MLX may run much later.
        dx = _times(cotangent.astype(mx.float32), widened(w))
        dw = _transposed_times(widened(cotangent), widened(x), w.ndim)
        return dx.astype(x.dtype), dw.astype(w.dtype)

    @matmul.vmap
    def matmul_vmap(inputs, axes):
        # Vmapped without this rule, MLX would differentiate the ops above, not matmul_vjp, and keep
        # their fp32 copies for the backward pass; with it, the replicas' weights are one (n, D, C).
        (x, w), (x_axis, w_axis) = inputs, axes
        if w_axis is None:
            return matmul(mx.moveaxis(x, x_axis, 0), w), 0
        w = mx.moveaxis(w, w_axis, 0)
        x = mx.broadcast_to(x, (w.shape[0], *x.shape)) if x_axis is None else mx.moveaxis(x, x_axis, 0)
        return matmul(x, w), 0
    return matmul


def _times_transposed(x, w):
    """x @ w.T, each replica's x by its own w when w is (n, D, C)."""
    if w.ndim == 2:
        return x @ w.T
    return (x.reshape(w.shape[0], -1, x.shape[-1]) @ w.swapaxes(-1, -2)).reshape(*x.shape[:-1], w.shape[1])


def _times(g, w):
    """g @ w: the gradient of x @ w.T with respect to x."""
    if w.ndim == 2:
        return g @ w
    return (g.reshape(w.shape[0], -1, g.shape[-1]) @ w).reshape(*g.shape[:-1], w.shape[-1])


def _transposed_times(g, x, w_ndim):
    """The gradient of x @ w.T with respect to w: g.T @ x over all tokens (per replica)."""
    if w_ndim == 2:
        return g.reshape(-1, g.shape[-1]).T @ x.reshape(-1, x.shape[-1])
    n = g.shape[0]
    return g.reshape(n, -1, g.shape[-1]).swapaxes(-1, -2) @ x.reshape(n, -1, x.shape[-1])


matmul_fp32 = _matmul_in_fp32(out_fp32=False)
# The output head's: the loss reads the logits in fp32, so rounding them to bf16 and back would
# only cost memory (two more copies of the largest activation) and precision.
logits_fp32 = _matmul_in_fp32(out_fp32=True)


class Fp32MatmulLinear(nn.Linear):
    matmul = staticmethod(matmul_fp32)

    def __call__(self, x):
        y = self.matmul(x, self["weight"])
        return y + self["bias"] if "bias" in self else y


class Fp32LogitsLinear(Fp32MatmulLinear):  # an output head (mlx-lm's `lm_head`)
    matmul = staticmethod(logits_fp32)


class Fp32MatmulEmbedding(nn.Embedding):
    def as_linear(self, x):  # a tied output head
        return logits_fp32(x, self.weight)


def round_bf16_stochastically(x: mx.array, seed: mx.array = None) -> mx.array:
    """fp32 -> bf16, rounding up or down with probability given by the distance (unbiased): an
    update smaller than bf16's resolution still moves the weight on average. Rounded to nearest,
    those updates are lost: small GPT, DiLoCo, 500 steps, eval loss +1.1% against fp32
    (docs/memory.md). `seed`: 32 random bits (uint32), one draw for a whole update.

    A dither in [0, 2**16) added to the fp32 bits carries into bf16's last bit with the
    probability of the 16 bits that bf16 drops. Its ops are elementwise and few, so that after the
    update's kernel the rounding is one more (MLX fuses no kernel across a bit view, nor a chain
    deeper than 11 ops); on a GPU each launch costs (issue 35)."""
    bits = x.view(mx.uint32)
    seed = random_word() if seed is None else seed
    return ((bits + dither16(bits, seed)) >> 16).astype(mx.uint16).view(mx.bfloat16)


def random_word() -> mx.array:
    """32 uniform random bits (a uint32 scalar) from MLX's random state. (randint over a range
    wider than 2**24 scales a float32 uniform: its low bits come out zero.)"""
    halves = mx.random.randint(0, 1 << 16, (2,), dtype=mx.uint32)
    return halves[0] | (halves[1] << 16)


def dither16(bits: mx.array, seed: mx.array) -> mx.array:
    """Uniform noise in [0, 2**16) for each value, independent from value to value: the value's
    bits plus a word for its position (position_words), xored with the seed, then multiplied by
    odd constants and xor-shifted. For any value and position the map from the seed is a
    bijection of 32-bit words, so a uniform seed gives a uniform dither (each rounding unbiased);
    equal values at different positions hash different words, so they round independently (a
    tensor that starts constant, like a norm's weights, would otherwise move all together: its
    mean's noise sqrt(n) times independent rounding's, issue 47). One seed for all parameters and
    no array made at a step: MLX's randint, or an arange, would each be a kernel a parameter."""
    rows, cols = position_words(tuple(bits.shape))
    h = ((bits + rows + cols) ^ seed) * 0x9E3779B1
    h = (h ^ (h >> 15)) * 0x85EBCA77
    return h >> 16


@lru_cache(maxsize=None)
def position_words(shape: tuple) -> tuple:
    """Two uint32 arrays whose broadcast sum gives each position of a `shape` tensor its own
    pseudo-random word: one word per row (every axis but the last) and one per column. Made once
    per shape and held (constants of the compiled update: no kernel at a step), they take
    4 bytes per row and per column, not per value. Pseudo-random rather than the index, so that
    no two positions' words differ by the small amounts that nearby values' bits differ by."""
    if not shape:
        return mx.array(_mix(np.arange(1, dtype=np.uint32))[0]), mx.array(np.uint32(0))
    n_rows = int(np.prod(shape[:-1]))
    rows = _mix(np.arange(n_rows, dtype=np.uint32) + np.uint32(0x6A09E667)).reshape(*shape[:-1], 1)
    return mx.array(rows), mx.array(_mix(np.arange(shape[-1], dtype=np.uint32)))


def _mix(words: np.ndarray) -> np.ndarray:
    """A bijection of uint32 words that spreads consecutive ones over all 32 bits (MurmurHash3's
    finalizer; numpy, once per shape)."""
    h = words.astype(np.uint32)
    with np.errstate(over="ignore"):
        h ^= h >> np.uint32(16)
        h *= np.uint32(0x85EBCA6B)
        h ^= h >> np.uint32(13)
        h *= np.uint32(0xC2B2AE35)
        h ^= h >> np.uint32(16)
    return h


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
    """Weights in bf16; on the CPU, linear layers and mlx-lm's attention multiply in fp32 (and the
    output head returns fp32 logits)."""
    model.set_dtype(mx.bfloat16)
    if not paths().fp32_matmul:
        return model
    for path, m in model.named_modules():
        if type(m) is nn.Linear:
            m.__class__ = Fp32LogitsLinear if path == "lm_head" else Fp32MatmulLinear
        elif type(m) is nn.Embedding:
            m.__class__ = Fp32MatmulEmbedding
    # mlx-lm's architectures call scaled_dot_product_attention from their module's globals.
    module = sys.modules.get(type(model).__module__)
    attention = getattr(module, "scaled_dot_product_attention", None)
    if attention is not None and not hasattr(attention, "wrapped"):
        module.scaled_dot_product_attention = fp32_attention(attention)
    return model
