"""Trees of arrays with a leading worker axis (exchange/comm.py's convention: one row per worker
this process hosts), and the helpers that make, slice and flatten them."""

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map, tree_unflatten


def stack_copies(tree, n: int):
    """The same values for n workers, on a new leading axis."""
    return tree_map(lambda x: mx.broadcast_to(x[None], (n, *x.shape)), tree)


def replica(tree, i: int = 0):
    """Worker i's values of a tree of (n, ...) arrays, as views: MLX copies on an integer index
    (`x[i]`: a whole model's worth of memory for a model's parameters), not on a slice."""
    return tree_map(lambda x: x[i:i + 1].reshape(x.shape[1:]), tree)


def placeholders(tree):
    """Unevaluated zeros shaped like `tree`: its shapes and dtypes without its memory."""
    return tree_map(lambda x: mx.zeros(x.shape, x.dtype), tree)


def flatten_workers(tree):
    """A tree of (n, ...) arrays -> one (n, L) float32 buffer, and how to undo it."""
    flat = tree_flatten(tree)
    n = flat[0][1].shape[0]
    shapes = [(k, v.shape[1:]) for k, v in flat]
    buffer = mx.concatenate([v.reshape(n, -1).astype(mx.float32) for _, v in flat], axis=1)
    return buffer, shapes


def unflatten(buffer, shapes):
    """(..., L) -> the tree `flatten_workers` described, with the buffer's leading axes (if any)."""
    out, offset, lead = [], 0, buffer.shape[:-1]
    for key, shape in shapes:
        size = 1
        for d in shape:
            size *= d
        out.append((key, buffer[..., offset:offset + size].reshape(*lead, *shape)))
        offset += size
    return tree_unflatten(out)
