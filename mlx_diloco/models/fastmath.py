"""Attention and cross-entropy through powers of two: the CPU's path (kernels.py decides).

MLX's CPU `exp` is scalar: measured here, 19.6 ms for 1M floats against 7.3 ms for 2**x, and the
attention softmax and the loss are most of the exponentials of a step. e**x = 2**(x log2 e), so
the results are the same up to float rounding. `bench/fastmath.py` measures a training step both ways.
"""

import mlx.core as mx

LOG2E = 1.4426950408889634


def _exp(x):
    return mx.power(2.0, x * LOG2E)


def softmax(x, axis: int = -1):
    e = _exp(x - mx.stop_gradient(x.max(axis=axis, keepdims=True)))
    return e / e.sum(axis=axis, keepdims=True)


def causal_attention(q, k, v, scale: float):
    """softmax(q k^T * scale + causal mask) v over (B, heads, T, head size), op by op."""
    T = q.shape[-2]
    scores = (q @ k.swapaxes(-1, -2)) * scale
    causal = mx.triu(mx.full((T, T), -mx.inf, dtype=scores.dtype), k=1)
    return softmax(scores + causal, axis=-1) @ v


def token_cross_entropy(logits, targets):
    """Each target's cross-entropy (nn.losses.cross_entropy's reduction="none") in fp32."""
    logits = logits.astype(mx.float32)
    top = mx.stop_gradient(logits.max(axis=-1, keepdims=True))
    logsumexp = mx.log(_exp(logits - top).sum(axis=-1)) + top[..., 0]
    return logsumexp - mx.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
