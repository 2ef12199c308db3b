"""A training step as an MLX user writes it: the baseline bench/throughput.py holds the project's
step against.

    python bench/mlx_baseline.py [--model gpt2-124m] [--precision bf16] [--batch-size 8] [--seq-len 1024]
    python bench/mlx_baseline.py --lora FOLDER [--lora-rank 8] ...     # mlx-lm's LoRA trainer step

No project code. A GPT preset of models/ is nanoGPT, written here in MLX with its fused kernels
(`mx.fast.scaled_dot_product_attention` with the causal mask, nn.LayerNorm, the head tied to the
token embedding); a Llama preset is mlx-lm's own Model class. The step: `nn.value_and_grad`,
`optim.clip_grad_norm`, AdamW with the trainer's settings (warmup then cosine to a tenth, betas,
eps 1e-8, weight decay, bias correction; read from config.py, which imports no MLX), and
`mx.compile` with the model, optimizer and random state in and out. bf16: `model.set_dtype`, as
mlx-lm does (AdamW's moments then bf16 too). `--lora`: mlx-lm's own fine-tuning step on a model
folder: `linear_to_lora_layers`, `mlx_lm.tuner.trainer.default_loss`, compiled as its `train()`
compiles it, with mlx_lm.lora's default optimizer (Adam, no clipping).
"""

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mlx_diloco.config import TrainConfig  # noqa: E402  (MLX-free: the trainer's settings)


class Attention(nn.Module):
    def __init__(self, n_embd, n_head, bias):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)

    def __call__(self, x):
        B, T, C = x.shape
        q, k, v = (t.reshape(B, T, self.n_head, -1).transpose(0, 2, 1, 3) for t in mx.split(self.c_attn(x), 3, axis=-1))
        y = mx.fast.scaled_dot_product_attention(q, k, v, scale=q.shape[-1] ** -0.5, mask="causal")
        return self.c_proj(y.transpose(0, 2, 1, 3).reshape(B, T, C))


ACTIVATIONS = {"gelu": nn.gelu_approx, "relu": nn.relu, "relu2": lambda x: mx.square(nn.relu(x))}


class Block(nn.Module):
    def __init__(self, n_embd, n_head, bias, activation):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd, bias=bias), nn.LayerNorm(n_embd, bias=bias)
        self.attn = Attention(n_embd, n_head, bias)
        self.c_fc, self.c_proj = nn.Linear(n_embd, 4 * n_embd, bias=bias), nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.act = ACTIVATIONS[activation]

    def __call__(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(self.act(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, vocab_size, context_length, n_layer, n_head, n_embd, bias=False, activation="gelu"):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab_size, n_embd), nn.Embedding(context_length, n_embd)
        self.h = [Block(n_embd, n_head, bias, activation) for _ in range(n_layer)]
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)

    def __call__(self, idx):
        x = self.wte(idx) + self.wpe(mx.arange(idx.shape[-1]))
        for block in self.h:
            x = block(x)
        return self.wte.as_linear(self.ln_f(x))


def build(preset: dict) -> nn.Module:
    kind = preset.pop("type")
    if kind == "gpt":
        return GPT(**preset)
    from mlx_lm.utils import _get_classes
    model_class, args_class = _get_classes({"model_type": kind})
    return model_class(args_class.from_dict({"model_type": kind, **preset}))


def read_preset(name: str) -> dict:
    path = Path(name) if name.endswith(".json") else ROOT / "models" / f"{name}.json"
    return json.loads(path.read_text())


def schedule(config: TrainConfig):
    """Linear warmup, then a cosine to a tenth of the peak: the trainer's."""
    warmup = min(config.warmup_steps(), config.steps - 1)
    cosine = optim.cosine_decay(config.lr, config.steps - warmup, end=config.lr * 0.1)
    return optim.join_schedules([optim.linear_schedule(0.0, config.lr, warmup), cosine], [warmup])


def pretraining_step(model_name: str, precision: str, batch_size: int, seq_len: int):
    config = TrainConfig.from_dict(dict(model=model_name, batch_size=batch_size, seq_len=seq_len, workers=1))
    model = build(read_preset(model_name))
    if precision == "bf16":
        model.set_dtype(mx.bfloat16)
    optimizer = optim.AdamW(learning_rate=schedule(config), betas=[config.beta1, config.beta2], eps=1e-8,
                            weight_decay=config.weight_decay, bias_correction=True)

    def loss_fn(model, x, y):
        return nn.losses.cross_entropy(model(x), y, reduction="mean")

    loss_and_grad = nn.value_and_grad(model, loss_fn)
    state = [model.state, optimizer.state, mx.random.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step(x, y):
        loss, grads = loss_and_grad(model, x, y)
        grads, _ = optim.clip_grad_norm(grads, config.grad_clip)
        optimizer.update(model, grads)
        return loss

    tokens = mx.random.randint(0, model_vocab(model), (batch_size, seq_len + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]

    def run():
        loss = step(x, y)
        mx.eval(loss, state)
    run.lazy = lambda: (step(x, y), state)  # the step's graph, not evaluated (bench/step_kernels.py)
    return run


def model_vocab(model) -> int:
    embedding = model.wte if isinstance(model, GPT) else model.model.embed_tokens
    return embedding.weight.shape[0]


def lora_step(folder: str, precision: str, batch_size: int, seq_len: int, rank: int, num_layers: int):
    """mlx-lm's LoRA step (mlx_lm.tuner.trainer.train's, one update per batch) on a model folder."""
    from mlx_lm.tuner.trainer import default_loss
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load_model
    model, _ = load_model(Path(folder))
    if precision == "bf16":
        model.set_dtype(mx.bfloat16)
    model.freeze()
    linear_to_lora_layers(model, num_layers, {"rank": rank, "scale": 20.0, "dropout": 0.0})
    optimizer = optim.Adam(learning_rate=1e-5)  # mlx_lm.lora's defaults
    loss_value_and_grad = nn.value_and_grad(model, default_loss)
    state = [model.state, optimizer.state, mx.random.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step(batch, lengths):
        (loss, toks), grad = loss_value_and_grad(model, batch, lengths)
        optimizer.update(model, grad)
        return loss, toks

    rng = np.random.default_rng(0)
    batch = mx.array(rng.integers(0, model_vocab(model), (batch_size, seq_len + 1)))
    lengths = mx.array([[0, seq_len]] * batch_size)  # (offset, length): every token trained

    def run():
        loss, toks = step(batch, lengths)
        mx.eval(loss, toks, state)
    return run


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small", help="preset of models/ (GPT or an mlx-lm type)")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=10, help="timed steps (after 3 of warm-up)")
    p.add_argument("--lora", metavar="FOLDER", help="mlx-lm's LoRA step on this mlx-lm model folder instead")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--num-layers", type=int, default=-1, help="blocks with adapters (-1: all)")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.lora:
        step = lora_step(args.lora, args.precision, args.batch_size, args.seq_len, args.lora_rank, args.num_layers)
    else:
        step = pretraining_step(args.model, args.precision, args.batch_size, args.seq_len)
    from step_server import serve, step_times  # (bench/, beside this file)
    if args.serve:
        return serve(step, f"MLX {mx.__version__}, {mx.default_device()}", mx.get_peak_memory)
    best, median = step_times(step, args.steps)
    tokens = args.batch_size * args.seq_len
    print(f"plain MLX {mx.__version__} on {mx.default_device()}, {args.lora or args.model} {args.precision}, "
          f"{args.batch_size}x{args.seq_len} tokens a step: {tokens / best:,.0f} tokens/s best, "
          f"{tokens / median:,.0f} median; peak {mx.get_peak_memory() / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
