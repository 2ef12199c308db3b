"""The kernels a model runs on this device, decided once per process (`paths()`).

On a GPU (Apple's Metal, or CUDA), MLX's fused kernels are the fast path: scaled dot-product
attention, layer and RMS norm, RoPE and cross-entropy, each one kernel forward and one backward.
On the CPU, MLX has no kernels for them (its fused functions run their op-by-op definitions there)
and its `exp` is a scalar loop: attention's softmax and the loss go through powers of two instead
(fastmath.py; bench/fastmath.py measures it), and bf16 layers multiply in fp32 (precision.py).

Replicas vmapped over a worker axis (training/workers.py) would lose the fused kernels: MLX vmaps
one by its op-by-op definition (`fast::Custom::vmap`). Inside `replica_axis()`, MLX's fused
functions are replaced by ones whose vmap rule folds the replica axis into the batch axis and
calls the same kernel (the replicas' sequences are as independent as a batch's), with a norm's
per-replica weight and bias applied after it. The workers trace their vmapped step inside it, so
this holds for any model that calls `mx.fast` (ours, mlx-lm's), and the gradients are taken of
the vmapped losses (the fold's graph, differentiated by the kernels' own backward passes).
"""

from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx

from . import fastmath

FAST_NAMES = ("scaled_dot_product_attention", "layer_norm", "rms_norm", "rope", "cross_entropy")
FAST = {name: getattr(mx.fast, name) for name in FAST_NAMES}  # MLX's own, as imported


@dataclass(frozen=True)
class KernelPaths:
    """What this process's models run. `fused`: MLX's fused kernels (attention, norms, RoPE,
    cross-entropy), folded under vmap; else softmax and cross-entropy through powers of two.
    `fp32_matmul`: bf16 layers multiply in fp32 and round the result to bf16."""
    device: str
    fused: bool
    fp32_matmul: bool

    @classmethod
    def for_device(cls, device) -> "KernelPaths":
        gpu = device == mx.gpu
        # the CPU: powers of two measured 1.19x a step (bench/results/fastmath.txt); no fast bf16 matmul
        return cls(device="gpu" if gpu else "cpu", fused=gpu, fp32_matmul=not gpu)

    def describe(self, precision: str = "bf16") -> str:
        kernels = "fused attention, norms, cross-entropy" if self.fused else "attention and loss through 2**x"
        bf16 = "; bf16 layers multiply in fp32" if self.fp32_matmul and precision == "bf16" else ""
        return f"{self.device}: {kernels}{bf16}"


_chosen = None


def paths() -> KernelPaths:
    """This process's paths, decided at the first call from MLX's default device."""
    global _chosen
    if _chosen is None:
        _chosen = KernelPaths.for_device(mx.default_device())
    return _chosen


@contextmanager
def chosen(**fields):
    """These paths instead of the device's, inside (tests compare the paths on the CPU)."""
    global _chosen
    before = _chosen
    _chosen = KernelPaths(**{**paths().__dict__, **fields})
    try:
        yield _chosen
    finally:
        _chosen = before


# ---------------------------------------------------------------- folding the replica axis

def _fold(arrays, axes):
    """Arrays vmapped on `axes` (None: not vmapped) -> each with the replica axis folded into its
    first axis (one that is not vmapped is repeated for every replica), and the replica count."""
    n = next(a.shape[ax] for a, ax in zip(arrays, axes) if ax is not None)
    folded = []
    for a, ax in zip(arrays, axes):
        a = mx.broadcast_to(a[None], (n, *a.shape)) if ax is None else mx.moveaxis(a, ax, 0)
        folded.append(a.reshape(n * a.shape[1], *a.shape[2:]))
    return folded, n


def _unfold(y, n):
    return y.reshape(n, y.shape[0] // n, *y.shape[1:])


def _per_replica(w, axis, ndim):
    """A norm's weight or bias (vmapped on `axis`, or shared) shaped to scale an unfolded (n, ..., C) output."""
    if w is None:
        return None
    if axis is None:
        return w
    w = mx.moveaxis(w, axis, 0)
    return w.reshape(w.shape[0], *([1] * (ndim - 2)), w.shape[-1])


def _with_fold(kernel, fold_rule):
    """kernel as an mx.custom_function with the vmap rule fold_rule(inputs, axes), both lists (MLX
    hands a function of one array its array and axis alone)."""
    f = mx.custom_function(kernel)

    @f.vmap
    def rule(inputs, axes):
        if isinstance(inputs, mx.array):
            inputs, axes = [inputs], [axes]
        return fold_rule(list(inputs), list(axes))
    return f


@lru_cache(maxsize=None)
def _folded_attention(scale: float, mask):
    sdpa = FAST["scaled_dot_product_attention"]

    def rule(inputs, axes):
        (q, k, v), n = _fold(inputs, axes)
        return _unfold(sdpa(q, k, v, scale=scale, mask=mask), n), 0
    return _with_fold(lambda q, k, v: sdpa(q, k, v, scale=scale, mask=mask), rule)


def attention(q, k, v, *, scale, mask=None, **kwargs):
    if (mask is None or isinstance(mask, str)) and not kwargs:
        return _folded_attention(scale, mask)(q, k, v)
    return FAST["scaled_dot_product_attention"](q, k, v, scale=scale, mask=mask, **kwargs)


@lru_cache(maxsize=None)
def _folded_norm(name: str, eps: float, has_weight: bool, has_bias: bool):
    """layer_norm(x, weight, bias) or rms_norm(x, weight) with the arrays it has; under vmap the
    kernel normalizes the folded x and the per-replica weight and bias apply after it."""
    kernel = FAST[name]

    def normalize(x, w=None, b=None):
        return kernel(x, w, b, eps) if name == "layer_norm" else kernel(x, w, eps)

    def call(x, *wb):
        return normalize(x, wb[0] if has_weight else None, wb[-1] if has_bias else None)

    def rule(inputs, axes):
        (x,), n = _fold(inputs[:1], axes[:1])
        y = _unfold(normalize(x), n)
        wb = [_per_replica(a, ax, y.ndim) for a, ax in zip(inputs[1:], axes[1:])]
        if has_weight:
            y = y * wb[0]
        if has_bias:
            y = y + wb[-1]
        return y, 0
    return _with_fold(call, rule)


def layer_norm(x, weight, bias, eps, **kwargs):
    if kwargs:  # (a stream): MLX's own
        return FAST["layer_norm"](x, weight, bias, eps, **kwargs)
    arrays = [a for a in (weight, bias) if a is not None]
    return _folded_norm("layer_norm", eps, weight is not None, bias is not None)(x, *arrays)


def rms_norm(x, weight, eps, **kwargs):
    if kwargs:
        return FAST["rms_norm"](x, weight, eps, **kwargs)
    arrays = [weight] if weight is not None else []
    return _folded_norm("rms_norm", eps, weight is not None, False)(x, *arrays)


@lru_cache(maxsize=None)
def _folded_rope(dims, traditional, base, scale, offset):
    kernel = FAST["rope"]

    def call(x):
        return kernel(x, dims, traditional=traditional, base=base, scale=scale, offset=offset)

    def rule(inputs, axes):
        (x,), n = _fold(inputs, axes)
        return _unfold(call(x), n), 0
    return _with_fold(call, rule)


def rope(a, dims, *, traditional, base, scale, offset, freqs=None, **kwargs):
    if freqs is None and isinstance(offset, int) and not kwargs:
        return _folded_rope(dims, traditional, base, scale, offset)(a)
    return FAST["rope"](a, dims, traditional=traditional, base=base, scale=scale, offset=offset, freqs=freqs, **kwargs)


def _cross_entropy_rule(inputs, axes):
    (logits, targets), n = _fold(inputs, axes)
    return _unfold(FAST["cross_entropy"](logits, targets), n), 0


_folded_cross_entropy = _with_fold(lambda logits, targets: FAST["cross_entropy"](logits, targets), _cross_entropy_rule)


def cross_entropy(logits, targets, **kwargs):
    return _folded_cross_entropy(logits, targets) if not kwargs else FAST["cross_entropy"](logits, targets, **kwargs)


FOLDED = {"scaled_dot_product_attention": attention, "layer_norm": layer_norm, "rms_norm": rms_norm,
          "rope": rope, "cross_entropy": cross_entropy}


@contextmanager
def replica_axis():
    """Trace a vmapped function inside: with fused kernels, MLX's fused functions fold the replica
    axis into the batch axis (see above); on the unfused path, nothing changes."""
    if not paths().fused:
        yield
        return
    for name, fn in FOLDED.items():
        setattr(mx.fast, name, fn)
    try:
        yield
    finally:
        for name, fn in FAST.items():
            setattr(mx.fast, name, fn)


# ---------------------------------------------------------------- what the models and losses call

def causal_attention(q, k, v, scale: float):
    """softmax(q k^T * scale + causal mask) v over (B, heads, T, head size)."""
    if paths().fused:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")
    return fastmath.causal_attention(q, k, v, scale)


def token_cross_entropy(logits, targets):
    """Each target's cross-entropy, in fp32 (bf16 logits are read as they are: the fused kernel
    accumulates in fp32)."""
    if paths().fused:
        return mx.fast.cross_entropy(logits, targets)
    return fastmath.token_cross_entropy(logits, targets)
