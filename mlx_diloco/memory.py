"""How much memory one worker needs: an estimate from the model's shape, before anything runs.

    weights, gradients          P x (4 bytes fp32, 2 bf16)
    AdamW moments               2P x (4 or 2)
    DiLoCo's outer state        the global model and the outer momentum: 2P x 4 (fp32 always)
    activations                 per block, what the backward pass keeps (or, checkpointed, only each
                                block's input and one block's recomputation), plus the logits
    the sync                    one fragment's pseudo-gradient buffers, 1/P of the model each

The activation constants are fitted to MLX's measured peak memory (`bench/memory.py`, which
prints the estimate beside the measurement). MLX-free: `plan`, `doctor` and the launcher use it.
"""

from dataclasses import dataclass

GB = 1e9
MAC_MEMORY_GB = (16, 24, 32, 64)  # the Macs people pool
# macOS lets the GPU wire about this share of a Mac's memory (MLX's recommended working set:
# 16 GB of a 24 GB Mac); `sudo sysctl iogpu.wired_limit_mb=...` raises it.
GPU_SHARE = 2 / 3


@dataclass
class Shape:
    """What the estimate needs to know of a model."""
    parameters: int
    blocks: int = 0          # transformer blocks (0: not a transformer)
    hidden: int = 0
    ffn: int = 0             # MLP width
    heads: int = 0
    vocab: int = 0


def model_shape(params: dict, parameters: int) -> Shape:
    """The Shape of a preset (our GPT, or an mlx-lm config) with `parameters` counted elsewhere."""
    hidden = params.get("n_embd") or params.get("hidden_size") or 0
    return Shape(parameters, params.get("n_layer") or params.get("num_hidden_layers") or 0, hidden,
                 params.get("intermediate_size") or 4 * hidden, params.get("n_head") or
                 params.get("num_attention_heads") or 0, params.get("vocab_size") or 0)


def estimate(shape: Shape, batch: int, seq_len: int, precision: str = "fp32", moments: str = "fp32",
             grad_checkpoint: bool = False, strategy: str = "diloco", fragments: int = 1,
             workers: int = 1) -> dict:
    """Bytes one process needs at its peak, by part, for `workers` replicas (1 on a cluster)."""
    P, w = shape.parameters, 2 if precision == "bf16" else 4
    m = 2 if moments == "bf16" else 4
    tokens = batch * max(seq_len, 1)
    # What the backward pass keeps per block and token: ~16 hidden-size values, ~3 MLP-width values
    # and the attention weights (heads x seq_len, softmax input and output).
    per_block = tokens * (16 * shape.hidden + 3 * shape.ffn + 2 * shape.heads * seq_len) * w
    if grad_checkpoint:
        stored = shape.blocks * tokens * shape.hidden * w + per_block
    else:
        stored = shape.blocks * per_block
    logits = 3 * tokens * shape.vocab * 4  # fp32 logits, their softmax and gradient
    outer = 2 * P * 4 if strategy in ("diloco", "fedavg", "sparta-diloco", "muloco") else 0
    parts = {
        "weights": workers * P * w + P * w,     # the replicas, and the model they were copied from
        "gradients": workers * P * w,
        "moments": workers * 2 * P * m,
        "outer state": outer,
        "activations": workers * (stored + logits),
        "sync": 3 * workers * P * 4 // max(fragments, 1) if outer else 0,
    }
    # The sync happens between steps: the gradients and activations are gone by then.
    step_peak = sum(v for k, v in parts.items() if k != "sync")
    sync_peak = step_peak - parts["gradients"] - parts["activations"] + parts["sync"]
    return {**parts, "total": max(step_peak, sync_peak)}


def fits(total_bytes: float, memory_bytes: float, gpu: bool = True) -> bool:
    """Does a job of `total_bytes` fit a machine of `memory_bytes` (on a Mac, what the GPU may wire)?"""
    return total_bytes <= memory_bytes * (GPU_SHARE if gpu else 0.9)


def macs_it_fits(total_bytes: float) -> list:
    return [gb for gb in MAC_MEMORY_GB if fits(total_bytes, gb * GB)]
