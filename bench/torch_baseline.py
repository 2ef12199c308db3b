"""A plain PyTorch training step of the project's GPT: the baseline bench/throughput.py compares with.

    pip install -e '.[bench]'        # torch==2.13.0, an optional extra (pyproject.toml: which build)
    python bench/torch_baseline.py [--model small] [--batch-size 16] [--seq-len 64] [--steps 20]
                                   [--device cpu|cuda|mps] [--precision fp32|bf16]

One worker's inner step as a PyTorch user would write it, the same computation as the project's
(`models/gpt.py`, `strategies/base.py`'s default_inner_optimizer, `training/workers.py`): nanoGPT's
GPT (token and position embeddings, pre-norm blocks of causal self-attention and an MLP, LayerNorms
and linears without bias as the preset says, the preset's activation, a final LayerNorm and a head
tied to the token embedding), mean cross-entropy on fp32 logits, global-norm clipping at grad_clip,
torch.optim.AdamW (bias correction, betas, eps 1e-8, decoupled weight decay on every parameter) with
the learning rate warmed up linearly then decayed by a cosine to a tenth. PyTorch's own defaults
otherwise: its thread count, its AdamW implementation, F.scaled_dot_product_attention. On any
device torch has (`--device`); bf16 as PyTorch users train in it, under autocast (fp32 weights).

It imports neither MLX nor the project's model code, only the run's settings (config.py, MLX-free):
tests/test_torch_baseline.py loads the same weights into both and checks that losses and parameters
agree step by step. `--serve` runs the protocol of bench/throughput.py's step processes.
"""

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mlx_diloco.config import TrainConfig  # noqa: E402  (MLX-free)
from mlx_diloco.options import ConfigError  # noqa: E402

ACTIVATIONS = {"gelu": lambda x: F.gelu(x, approximate="tanh"),  # MLX's nn.gelu_approx
               "relu": F.relu, "relu2": lambda x: F.relu(x).square()}


def read_gpt_preset(name: str) -> dict:
    """A GPT preset of models/ (a name or a .json path), with gpt.py's defaults for what it omits."""
    path = Path(name) if name.endswith(".json") else ROOT / "models" / f"{name}.json"
    if not path.is_file():
        raise ConfigError(f"no model preset {path}; pass a preset name of models/ (e.g. small) or its .json file")
    spec = json.loads(path.read_text())
    if spec.get("type") != "gpt":
        raise ConfigError(f"the PyTorch baseline builds GPT presets only; {name} is a {spec.get('type')!r} model")
    return {"bias": False, "activation": "gelu", **{k: v for k, v in spec.items() if k != "type"}}


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, bias):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in self.c_attn(x).split(C, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # softmax(q k^T / sqrt(d) + causal mask) v
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, n_embd, bias, activation):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.act = ACTIVATIONS[activation]

    def forward(self, x):
        return self.c_proj(self.act(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd, n_head, bias, activation):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, bias, activation)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """The project's GPT, with its parameter names (a state_dict key is an MLX parameter path)."""

    def __init__(self, vocab_size, context_length, n_layer, n_head, n_embd, bias=False, activation="gelu"):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ConfigError(f"unknown activation '{activation}'; choose one of {sorted(ACTIVATIONS)}")
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(context_length, n_embd)
        self.h = nn.ModuleList(Block(n_embd, n_head, bias, activation) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        proj_std = 0.02 / math.sqrt(2 * n_layer)  # nanoGPT's init, as gpt.py's
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=proj_std if name.endswith("c_proj.weight") else 0.02)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[-1], device=idx.device))
        for block in self.h:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)  # tied to the token embedding


def learning_rate(config: TrainConfig, update: int) -> float:
    """strategies/base.py's lr_schedule before update `update` (0-based): linear warmup from 0 to
    lr, then a cosine to lr / 10 at the end of the run."""
    peak, warmup = config.lr, min(config.warmup_steps(), config.steps - 1)
    if update < warmup:
        return peak * update / warmup
    decay_steps = max(config.steps - warmup, 1)
    progress = min(update - warmup, decay_steps) / decay_steps
    return peak * 0.1 + 0.5 * (1 + math.cos(math.pi * progress)) * (peak - peak * 0.1)


class TrainStep:
    """One worker's inner step: forward, backward, clipping, AdamW at the scheduled learning rate;
    with `autocast` (a dtype), the forward pass under torch.autocast."""

    def __init__(self, model: GPT, config: TrainConfig, autocast=None):
        self.model, self.config, self.updates, self.autocast = model, config, 0, autocast
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate(config, 0),
                                           betas=(config.beta1, config.beta2), eps=1e-8,
                                           weight_decay=config.weight_decay)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> float:
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(self.config, self.updates)
        with torch.autocast(x.device.type, dtype=self.autocast, enabled=self.autocast is not None):
            logits = self.model(x)
        loss = F.cross_entropy(logits.float().flatten(0, -2), y.flatten())
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.config.grad_clip > 0:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
        self.optimizer.step()
        self.updates += 1
        return loss.item()


def make_setup(model_name: str, batch_size: int, seq_len: int, seed: int = 0, device: str = "cpu",
               precision: str = "fp32"):
    """A ready-to-step closure: the baseline's step on one fixed batch of random tokens (the
    tokens' values do not change its cost), with the trainer's settings for everything else."""
    torch.manual_seed(seed)
    spec = read_gpt_preset(model_name)
    if seq_len > spec["context_length"]:
        raise ConfigError(f"seq-len {seq_len} is longer than {model_name}'s context; pass --seq-len "
                          f"{spec['context_length']} or less")
    config = TrainConfig.from_dict(dict(model=model_name, workers=1, batch_size=batch_size, seq_len=seq_len))
    step = TrainStep(GPT(**spec).to(device), config, autocast=torch.bfloat16 if precision == "bf16" else None)
    tokens = torch.randint(spec["vocab_size"], (batch_size, seq_len + 1), device=device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    return lambda: step(x, y)  # (its loss.item() waits for the device)


def label(device: str) -> str:
    version = torch.__version__.split('+')[0]
    return f"PyTorch {version}, {torch.get_num_threads()} threads" if device == "cpu" else f"PyTorch {version}, {device}"


def peak_bytes(device: str):
    return torch.cuda.max_memory_allocated() if device == "cuda" else None  # (the CPU's allocator counts none)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small", help="GPT preset of models/")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    p.add_argument("--steps", type=int, default=20, help="timed steps (after 2 of warm-up)")
    p.add_argument("--device", default="cpu", help="torch device: cpu, cuda, mps")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="bf16: under torch.autocast")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    try:
        step = make_setup(args.model, args.batch_size, args.seq_len, device=args.device, precision=args.precision)
    except ConfigError as e:
        sys.exit(f"error: {e}")
    from step_server import serve, step_times  # (bench/, beside this file)
    if args.serve:
        return serve(step, label(args.device), lambda: peak_bytes(args.device))
    best, median = step_times(step, args.steps, warmup=2)
    tokens = args.batch_size * args.seq_len
    print(f"{label(args.device)}, {args.precision}, model {args.model}, "
          f"{args.batch_size}x{args.seq_len} tokens a step: {tokens / best:,.0f} tokens/s best, "
          f"{tokens / median:,.0f} median of {args.steps} steps")


if __name__ == "__main__":
    main()
