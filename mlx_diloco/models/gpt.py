"""A GPT in the style of nanoGPT, written in MLX.

Token and position embeddings, pre-norm transformer blocks (causal self-attention and an MLP),
a final LayerNorm and a language-model head tied to the token embedding.
"""

import math
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path

from ..options import from_dict
from .kernels import causal_attention


@dataclass
class GPTArgs:
    vocab_size: int = 2048
    context_length: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    bias: bool = False
    # relu is much faster than gelu on MLX's CPU backend (its exp/erf are scalar loops)
    activation: str = "gelu"

    @classmethod
    def from_dict(cls, params):
        return from_dict(cls, params, what="GPT model option")


ACTIVATIONS = {"gelu": nn.gelu_approx, "relu": nn.relu, "relu2": lambda x: mx.square(nn.relu(x))}


class CausalSelfAttention(nn.Module):
    def __init__(self, args: GPTArgs):
        super().__init__()
        self.n_head = args.n_head
        self.c_attn = nn.Linear(args.n_embd, 3 * args.n_embd, bias=args.bias)
        self.c_proj = nn.Linear(args.n_embd, args.n_embd, bias=args.bias)

    def __call__(self, x):
        B, T, C = x.shape
        q, k, v = mx.split(self.c_attn(x), 3, axis=-1)
        q, k, v = (t.reshape(B, T, self.n_head, -1).transpose(0, 2, 1, 3) for t in (q, k, v))
        y = causal_attention(q, k, v, scale=q.shape[-1] ** -0.5)
        return self.c_proj(y.transpose(0, 2, 1, 3).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, args: GPTArgs):
        super().__init__()
        self.c_fc = nn.Linear(args.n_embd, 4 * args.n_embd, bias=args.bias)
        self.c_proj = nn.Linear(4 * args.n_embd, args.n_embd, bias=args.bias)
        self.act = ACTIVATIONS[args.activation]

    def __call__(self, x):
        return self.c_proj(self.act(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, args: GPTArgs):
        super().__init__()
        self.ln_1 = nn.LayerNorm(args.n_embd, bias=args.bias)
        self.attn = CausalSelfAttention(args)
        self.ln_2 = nn.LayerNorm(args.n_embd, bias=args.bias)
        self.mlp = MLP(args)

    def __call__(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, args: GPTArgs):
        super().__init__()
        if args.activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation '{args.activation}'; choose one of {sorted(ACTIVATIONS)}")
        self.args = args
        self.wte = nn.Embedding(args.vocab_size, args.n_embd)
        self.wpe = nn.Embedding(args.context_length, args.n_embd)
        self.h = [Block(args) for _ in range(args.n_layer)]
        self.ln_f = nn.LayerNorm(args.n_embd, bias=args.bias)
        self._init_weights()

    def _init_weights(self):
        # nanoGPT: N(0, 0.02) everywhere, residual projections scaled by 1/sqrt(2 * n_layer)
        proj_std = 0.02 / math.sqrt(2 * self.args.n_layer)
        def init(path, p):
            if path.endswith("bias") or ".ln_" in f".{path}":
                return p
            std = proj_std if path.endswith("c_proj.weight") else 0.02
            return mx.random.normal(p.shape) * std
        self.update(tree_map_with_path(init, self.parameters()))

    def __call__(self, idx):
        T = idx.shape[-1]
        x = self.wte(idx) + self.wpe(mx.arange(T))
        for block in self.h:
            x = block(x)
        return self.wte.as_linear(self.ln_f(x))  # weight tying, as in GPT-2
