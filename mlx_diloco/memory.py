"""How much memory one worker needs: an estimate from the model's shape, before anything runs.

    weights, gradients          P x (4 bytes fp32, 2 bf16)
    AdamW moments               2P x (4 or 2)
    DiLoCo's outer state        the global model and the outer momentum: 2P x 4 (fp32 always), or
                                nothing with offload-outer (they wait in a file between syncs)
    activations                 per block, what the backward pass keeps, plus the logits (or,
                                checkpointed, each block's input and the larger of one block's
                                recomputation and the loss's piece)
    the sync                    one fragment's pseudo-gradient buffers (1/P of the model with
                                Streaming DiLoCo's P fragments): the peak of a large model with P=1
    the evaluation              the global model in the training precision and a forward pass

The activation constants are fitted to MLX's measured peak memory (`bench/memory.py`, which
prints the estimate beside the measurement). MLX-free: `plan`, `doctor` and the launcher use it.
"""

from dataclasses import dataclass, fields, replace

GB = 1e9
MAC_MEMORY_GB = (16, 24, 32, 64)  # the Macs people pool
# macOS lets the GPU wire about this share of a Mac's memory (MLX's recommended working set:
# 16 GB of a 24 GB Mac); `sudo sysctl iogpu.wired_limit_mb=...` raises it.
GPU_SHARE = 2 / 3
RUNTIME_BYTES = int(0.005 * GB)  # what MLX holds beside the model, the batch and the evaluation


@dataclass
class Shape:
    """What the estimate needs to know of a model."""
    parameters: int
    blocks: int = 0          # transformer blocks (0: not a transformer)
    hidden: int = 0
    ffn: int = 0             # MLP width
    heads: int = 0
    vocab: int = 0
    attention_copies: int = 1  # attention rows kept per token: 1 with mx.fast's attention, 3 with plain ops (our GPT)


def model_shape(params: dict, parameters: int) -> Shape:
    """The Shape of a preset (our GPT, or an mlx-lm config) with `parameters` counted elsewhere."""
    hidden = params.get("n_embd") or params.get("hidden_size") or 0
    return Shape(parameters, params.get("n_layer") or params.get("num_hidden_layers") or 0, hidden,
                 params.get("intermediate_size") or 4 * hidden, params.get("n_head") or
                 params.get("num_attention_heads") or 0, params.get("vocab_size") or 0,
                 attention_copies=3 if "n_head" in params else 1)


@dataclass
class MemoryOptions:
    """The choices that decide a worker's memory (config keys and DiLoCo options of the same names)."""
    batch_size: int = 16
    seq_len: int = 64
    precision: str = "fp32"
    moments_precision: str = "fp32"
    grad_checkpoint: bool = False
    offload_outer: bool = False
    fragments: int = 1
    strategy: str = "diloco"

    @classmethod
    def of(cls, config) -> "MemoryOptions":
        """The options of a TrainConfig (its seq-len resolved)."""
        o = config.strategy_options
        return cls(config.batch_size, config.seq_len, config.precision, config.moments_precision,
                   config.grad_checkpoint, o.get("offload_outer", False), o.get("fragments", 1), config.strategy)

    def describe(self) -> str:
        parts = [f"batch {self.batch_size} x {self.seq_len}", self.precision]
        parts += ["bf16 moments"] * (self.moments_precision == "bf16") + ["grad-checkpoint"] * self.grad_checkpoint
        parts += ["offload-outer"] * self.offload_outer + [f"{self.fragments} fragments"] * (self.fragments > 1)
        return ", ".join(parts)


def estimate(shape: Shape, o: MemoryOptions, workers: int = 1) -> dict:
    """Bytes one process needs at its peak, by part, for `workers` replicas (1 on a cluster)."""
    P, w = shape.parameters, 2 if o.precision == "bf16" else 4
    m = 2 if o.moments_precision == "bf16" else 4
    tokens = o.batch_size * max(o.seq_len, 1)
    # Activations, fitted to MLX's peaks on the CPU (bench/memory.py): per block and token the
    # backward pass keeps ~5 hidden-size, 3 MLP-width values and 1-3 attention rows in fp32 (bf16
    # on the CPU adds ~30%: the fp32 copies its matrix multiplies make); the loss ~18-22 bytes per
    # logit (the fp32 logits, their softmax and gradient), an evaluation ~12.
    per_block = tokens * 4 * (5 * shape.hidden + 3 * shape.ffn + shape.attention_copies * shape.heads * max(o.seq_len, 1))
    per_block *= 1.3 if o.precision == "bf16" else 1.0
    logits = tokens * shape.vocab
    if o.grad_checkpoint:
        # Block by block (models/checkpointing.py): every block's input is kept; the loss's piece of
        # the backward pass runs before any gradient exists, then one block's piece at a time
        # beside the gradients.
        activations = shape.blocks * tokens * shape.hidden * w + max(per_block, 18 * logits - P * w)
    else:
        activations = shape.blocks * per_block + 22 * logits
    periodic = o.strategy in ("diloco", "fedavg", "sparta-diloco", "muloco")
    fragment = P // max(o.fragments, 1)
    parts = {
        "runtime": RUNTIME_BYTES,
        "weights": workers * P * w,
        "gradients": workers * P * w,
        "moments": workers * 2 * P * m,
        "outer state": 2 * P * 4 if periodic and not o.offload_outer else 0,  # global model, momentum (fp32)
        "activations": workers * int(activations),
        # one fragment's buffers at a sync: its values, the pseudo-gradient and its mean, ~3.5 fp32
        # copies measured (offloaded, ~4: the global values and momentum read back, one at a time)
        "sync": int((3.5 * workers + 0.5 * o.offload_outer) * fragment * 4) if periodic else 0,
        # evaluating the global model: a copy of it in the training precision, and a forward pass
        "evaluation": (P * w if periodic else 0) + 12 * logits,
    }
    # The sync and the evaluations happen between steps: the gradients and activations are gone.
    step_peak = sum(v for k, v in parts.items() if k not in ("sync", "evaluation"))
    between_steps = step_peak - parts["gradients"] - parts["activations"]
    return {**parts, "total": max(step_peak, between_steps + parts["sync"], between_steps + parts["evaluation"])}


def macs_it_fits(total_bytes: float) -> list:
    """The Mac sizes (GB) whose GPU may wire a job of `total_bytes`."""
    return [gb for gb in MAC_MEMORY_GB if total_bytes <= gb * GB * GPU_SHARE]


def shrinking(shape: Shape, o: MemoryOptions) -> list:
    """What makes a job smaller, in the order worth trying: bf16, checkpointing and offloading
    leave the loss as it is, Streaming DiLoCo's fragments (two blocks each; DiLoCo only) shrink the
    sync and did better than DiLoCo in our runs, bf16 moments cost a little (docs/memory.md)."""
    changes = [("precision", "bf16"), ("grad_checkpoint", True), ("offload_outer", True)]
    if o.strategy == "diloco":
        changes.append(("fragments", max(shape.blocks // 2, o.fragments, 1)))
    return changes + [("moments_precision", "bf16")]


def make_it_fit(shape: Shape, o: MemoryOptions, budget: float):
    """The first options, changing as little as the list above allows (then halving the batch),
    whose estimate fits `budget` bytes; None if even batch 1 does not."""
    candidate = o
    for key, value in shrinking(shape, o):
        if estimate(shape, candidate)["total"] <= budget:
            return candidate
        candidate = replace(candidate, **{key: value})
    while estimate(shape, candidate)["total"] > budget:
        if candidate.batch_size == 1:
            return None
        candidate = replace(candidate, batch_size=candidate.batch_size // 2)
    return candidate


def flags(old: MemoryOptions, new: MemoryOptions) -> str:
    """The command-line flags that turn `old` into `new`."""
    out = []
    for f in fields(MemoryOptions):
        a, b = getattr(old, f.name), getattr(new, f.name)
        if a != b:
            out.append(f"--{f.name.replace('_', '-')}" + ("" if b is True else f" {b}"))
    return " ".join(out)
