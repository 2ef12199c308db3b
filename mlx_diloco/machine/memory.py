"""How much memory one worker needs: an estimate from the model's shape, before anything runs.

    weights, gradients          P x (4 bytes fp32, 2 bf16)
    AdamW moments               2P x (4 or 2)
    (fine-tuning with adapters: P is what trains, the adapters; the frozen base is one copy beside
    them, shared by the process's replicas, at its size as stored: a quantized base's packed bytes)
    the strategy's outer state  what it keeps between syncs (strategy.outer_copies: DiLoCo's global
                                model and outer momentum, 2P x 4, fp32 always), or nothing with
                                offload-outer (they wait in a file between syncs)
    activations                 per block, what the backward pass keeps, plus the logits (or,
                                checkpointed, each block's input and the larger of one block's
                                recomputation and the loss's piece)
    the sync                    one fragment's pseudo-gradient buffers (1/P of the model with
                                Streaming DiLoCo's P fragments): the peak of a large model with P=1
    the evaluation              the global model in the training precision and a forward pass
    the model as built          before the first evaluation casts it (a random preset: fp32), with
                                that evaluation's forward pass

The activation constants are fitted to MLX's measured peak memory (`bench/memory.py`, which
prints the estimate beside the measurement). MLX-free at import: `plan` prints these estimates,
`doctor` and the launcher use them. The strategy is asked what it keeps, never named.
"""

from dataclasses import dataclass, field, replace

from ..objectives.kinds import kind

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
    trainable: int = None    # parameters that train, when not all of them (adapters: models/finetune.py)
    frozen_bytes: dict = None  # the frozen base's bytes by training precision ({"fp32": ..., "bf16": ...})
    built_bytes: int = 0     # the model's bytes as built or loaded, before its cast (a random preset: fp32)


def model_shape(params: dict, parameters: int) -> Shape:
    """The Shape of a preset (our GPT, or an mlx-lm config) with `parameters` counted elsewhere."""
    hidden = params.get("n_embd") or params.get("hidden_size") or 0
    return Shape(parameters, params.get("n_layer") or params.get("num_hidden_layers") or 0, hidden,
                 params.get("intermediate_size") or 4 * hidden, params.get("n_head") or
                 params.get("num_attention_heads") or 0, params.get("vocab_size") or 0,
                 attention_copies=3 if "n_head" in params else 1)


# The choices `make_it_fit` may turn, as flags: config keys, and the strategy's own (`memory_savings`).
SETTINGS = ("batch_size", "seq_len", "precision", "moments_precision", "grad_checkpoint", "offload_outer",
            "fragments")


@dataclass
class MemoryOptions:
    """The choices that decide a worker's memory, from a config and its strategy (`of`)."""
    batch_size: int
    seq_len: int
    precision: str
    moments_precision: str
    grad_checkpoint: bool
    offload_outer: bool      # the strategy keeps its outer state in files between syncs (offloads_outer)
    fragments: int           # it syncs the model in this many pieces, one at a time (sync_pieces)
    outer_copies: int        # model-sized fp32 arrays the strategy keeps between syncs, unless offloaded
    worker_copies: int       # and those each worker keeps of its own (an error-feedback buffer)
    periodic: bool           # it syncs every H steps: a sync's buffers, and a global model to evaluate
    strategy: object = field(default=None, repr=False, compare=False)  # asked what of its own it can turn
    rows_per_example: int = 1   # the objective's sequences per example: DPO's pair 2, GRPO's group (objectives/kinds.py)
    reference: bool = False     # the objective keeps the starting policy (DPO, GRPO): a copy of what trains
    rollout_tokens: int = 0     # GRPO: the tokens one worker's rollouts hold at once (prompts and completions)

    @classmethod
    def of(cls, config, strategy) -> "MemoryOptions":
        """The options of a TrainConfig (its seq-len resolved) and the strategy built from it."""
        objective = kind(config.objective)
        rows = objective.rows_per_example(config)
        rollouts = config.batch_size * rows * (config.seq_len + config.max_completion_length) \
            if objective.data == "prompts" else 0
        return cls(config.batch_size, config.seq_len, config.precision, config.moments_precision,
                   config.grad_checkpoint, strategy.offloads_outer, strategy.sync_pieces,
                   strategy.outer_copies, strategy.worker_copies, strategy.sync_every > 0, strategy,
                   rows, objective.reference, rollouts)

    def describe(self) -> str:
        parts = [f"batch {self.batch_size} x {self.seq_len}", self.precision]
        parts += ["bf16 moments"] * (self.moments_precision == "bf16") + ["grad-checkpoint"] * self.grad_checkpoint
        parts += ["offload-outer"] * self.offload_outer + [f"{self.fragments} fragments"] * (self.fragments > 1)
        return ", ".join(parts)


def estimate(shape: Shape, o: MemoryOptions, workers: int = 1) -> dict:
    """Bytes one process needs at its peak, by part, for `workers` replicas (1 on a cluster)."""
    P, w = shape.parameters, 2 if o.precision == "bf16" else 4
    frozen = (shape.frozen_bytes or {}).get(o.precision, 0)  # one copy, whatever the replicas
    P = P if shape.trainable is None else shape.trainable   # from here on: what trains
    m = 2 if o.moments_precision == "bf16" else 4
    tokens = o.batch_size * o.rows_per_example * max(o.seq_len, 1)
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
    periodic = o.periodic
    fragment = P // max(o.fragments, 1)
    parts = {
        "runtime": RUNTIME_BYTES,
        "weights": workers * P * w + frozen,
        "gradients": workers * P * w,
        "moments": workers * 2 * P * m,
        "outer state": (0 if o.offload_outer else o.outer_copies * P * 4)  # e.g. global model, momentum (fp32)
        + workers * o.worker_copies * P * 4,
        "activations": workers * int(activations),
        # one fragment's buffers at a sync: its values, the pseudo-gradient and its mean, ~3.5 fp32
        # copies measured (offloaded, ~4: the global values and momentum read back, one at a time)
        "sync": int((3.5 * workers + 0.5 * o.offload_outer) * fragment * 4) if periodic else 0,
        # evaluating the global model: a copy of it in the training precision, and a forward pass
        "evaluation": (P * w if periodic else 0) + 12 * logits,
        # the model as built (a random preset: fp32) stays until the first evaluation casts it to
        # the training precision (measured: llama-1b, LoRA in bf16, 2 x 256: 4.65 GB then, its fp32
        # weights and a forward pass; 3.2 GB at most after, checkpointed)
        "as built": shape.built_bytes,
        # DPO and GRPO compare with the policy they started from: the starting values of what trains
        # (under LoRA the fresh adapters, the base itself being the reference: objectives/base.Reference)
        "reference": P * w if o.reference else 0,
        # GRPO's rollouts, one worker's at a time between steps: the KV cache (keys and values of each
        # block, a hidden-size each per token) and the sampled position's logits
        "rollouts": int(o.rollout_tokens * shape.blocks * 2 * shape.hidden * w
                        + o.rollout_tokens / max(o.seq_len, 1) * shape.vocab * 4) if o.rollout_tokens else 0,
    }
    # The sync and the evaluations happen between steps: the gradients and activations are gone.
    step_peak = sum(v for k, v in parts.items() if k not in ("sync", "evaluation", "as built", "rollouts"))
    between_steps = step_peak - parts["gradients"] - parts["activations"]
    first_evaluation = RUNTIME_BYTES + parts["as built"] + 12 * logits
    return {**parts, "total": max(step_peak, between_steps + parts["sync"], between_steps + parts["evaluation"],
                                  between_steps + parts["rollouts"], first_evaluation)}


def macs_it_fits(total_bytes: float) -> list:
    """The Mac sizes (GB) whose GPU may wire a job of `total_bytes`."""
    return [gb for gb in MAC_MEMORY_GB if total_bytes <= gb * GB * GPU_SHARE]


def shrinking(shape: Shape, o: MemoryOptions) -> list:
    """What makes a job smaller, in the order worth trying: bf16, checkpointing and offloading
    leave the loss as it is, the strategy's own (Streaming DiLoCo's fragments of two blocks each
    shrink the sync and did better than DiLoCo in our runs), bf16 moments cost a little
    (docs/memory.md)."""
    own = o.strategy.memory_savings(shape.blocks) if o.strategy is not None else []
    return [("precision", "bf16"), ("grad_checkpoint", True), *own, ("moments_precision", "bf16")]


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
    for name in SETTINGS:
        a, b = getattr(old, name), getattr(new, name)
        if a != b:
            out.append(f"--{name.replace('_', '-')}" + ("" if b is True else f" {b}"))
    return " ".join(out)


def trained_shape(config):
    """(preset spec, Shape) of the model a config trains, its fine-tune type applied (adapters: what
    trains, and the frozen base's bytes; a quantized base refused for full fine-tuning), without
    allocating the weights (MLX imported on call)."""
    from mlx.utils import tree_flatten
    from ..models.finetune import ADAPTER_TYPES, apply_fine_tune, frozen_bytes, is_quantized, trainable_count
    from ..models.zoo import build_model, count_parameters, load_spec
    spec = load_spec(config.model)
    model = build_model(spec, lazy=True)
    built = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    if is_quantized(model) and spec.path is None:  # a preset: made in fp32 and packed a layer at a time (zoo.quantize)
        built += max(4 * m.weight.size * 32 // m.bits for _, m in model.named_modules() if hasattr(m, "bits"))
    shape = replace(model_shape(spec.params, count_parameters(model)), built_bytes=built)
    apply_fine_tune(model, config)
    if config.fine_tune_type in ADAPTER_TYPES:
        shape = replace(shape, trainable=trainable_count(model),
                        frozen_bytes={p: frozen_bytes(model, p) for p in ("fp32", "bf16")})
    return spec, shape


def worker_estimate(config, strategy) -> tuple:
    """(MemoryOptions, Shape, estimate) of one worker of a resolved TrainConfig and its strategy
    (training/resolve.py; one worker per machine)."""
    _, shape = trained_shape(config)
    o = MemoryOptions.of(config, strategy)
    return o, shape, estimate(shape, o)


def on_this_machine(shape, o: MemoryOptions, total: float, budget: float) -> str:
    """Whether the job fits the `budget` bytes this machine offers, and the --memory-limit to
    train it with: never more than the machine has. MLX allocates each operation's output when it
    queues it, ahead of running it: unchecked, a step's peak can exceed what it needs by half
    (docs/memory.md)."""
    def limit(total):
        return f"--memory-limit {min(total * 1.05, budget) / GB:.3g}"  # GB; 0 would mean no limit
    here = f"on this machine ({budget / GB:.1f} GB for training)"
    if total <= budget:
        return f"{here}: keep the peak near the estimate with {limit(total)} (agents set it to what they offer)"
    smaller = make_it_fit(shape, o, budget)
    if smaller is None:
        return f"{here}: does not fit, even at batch size 1 with every option above; use a smaller model"
    smaller_total = estimate(shape, smaller)["total"]
    return f"{here}: does not fit as is; with {flags(o, smaller)} {limit(smaller_total)} ({smaller_total / GB:.2f} GB)"
