"""Attention and cross-entropy through powers of two: the CPU's path (kernels.py decides).

MLX's CPU `exp` is scalar: measured here, 19.6 ms for 1M floats against 7.3 ms for 2**x, and the
attention softmax and the loss are most of the exponentials of a step. e**x = 2**(x log2 e), so
the results are the same up to float rounding. `bench/fastmath.py` measures a training step both ways.
"""

import mlx.core as mx

LOG2E = 1.4426950408889634


def _exp(x):
    return mx.power(2.0, x * LOG2E)


@mx.custom_function
def _softmax_last(x):
    e = _exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


@_softmax_last.vjp
def _softmax_last_vjp(primals, cotangent, p):
    # From the output alone, as MLX's softmax: differentiating the ops above would keep their
    # (..., T, T) intermediates for the backward pass (measured: +10 MB of a 57 MB bf16 step at `small`)
    return p * (cotangent - (cotangent * p).sum(axis=-1, keepdims=True))


@_softmax_last.vmap
def _softmax_last_vmap(x, axis):
    # Rows are independent: vmapped on any axis but the last, it is the same call (vmapped without
    # a rule, MLX would differentiate the ops, not the vjp above)
    if axis == x.ndim - 1:
        x, axis = mx.moveaxis(x, axis, 0), 0
    return _softmax_last(x), axis


def softmax(x, axis: int = -1):
    if axis in (-1, x.ndim - 1):
        return _softmax_last(x)
    return mx.moveaxis(_softmax_last(mx.moveaxis(x, axis, -1)), -1, axis)


def causal_attention(q, k, v, scale: float):
    """softmax(q k^T * scale + causal mask) v over (B, heads, T, head size), op by op."""
    T = q.shape[-2]
    scores = (q @ k.swapaxes(-1, -2)) * scale
    causal = mx.triu(mx.full((T, T), -mx.inf, dtype=scores.dtype), k=1)
    return softmax(scores + causal, axis=-1) @ v


def token_cross_entropy(logits, targets):
    """Each target's cross-entropy (nn.losses.cross_entropy's reduction="none") in fp32."""
    return _cross_entropy(logits.astype(mx.float32), targets)


@mx.custom_function
def _cross_entropy(logits, targets):
    top = logits.max(axis=-1, keepdims=True)
    logsumexp = mx.log(_exp(logits - top).sum(axis=-1)) + top[..., 0]
    return logsumexp - _picked(logits, targets)


@_cross_entropy.vjp
def _cross_entropy_vjp(primals, cotangent, ce):
    # softmax(logits) - one-hot, recomputed from the logits (kept anyway) in one fused pass:
    # differentiating the ops above would keep their exponentials, as large as the logits, from the
    # forward pass to the backward (4 MB of fp32 at `small`, 16 x 64 tokens)
    logits, targets = primals
    logsumexp = ce + _picked(logits, targets)
    p = _exp(logits - logsumexp[..., None])
    one_hot = mx.arange(logits.shape[-1]) == targets[..., None]
    return (p - one_hot) * cotangent[..., None], mx.zeros_like(targets)


@_cross_entropy.vmap
def _cross_entropy_vmap(inputs, axes):
    # each token's own: the replica axis is one more batch axis
    (logits, targets), (logits_axis, targets_axis) = inputs, axes
    n = logits.shape[logits_axis] if logits_axis is not None else targets.shape[targets_axis]
    logits = mx.broadcast_to(logits, (n, *logits.shape)) if logits_axis is None else mx.moveaxis(logits, logits_axis, 0)
    targets = mx.broadcast_to(targets, (n, *targets.shape)) if targets_axis is None else mx.moveaxis(targets, targets_axis, 0)
    return _cross_entropy(logits, targets), 0


def _picked(logits, targets):
    return mx.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
