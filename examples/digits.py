"""An MLP on scikit-learn's handwritten digits, trained through the Python API with three
strategies on 4 simulated workers, compared in one plot. The model, the loss and the data are
plain MLX and NumPy: nothing here is part of mlx-diloco.

    .venv/bin/pip install -e '.[examples]'     # scikit-learn (its digits install offline)
    .venv/bin/python examples/digits.py [--steps 300] [--out runs/digits]
"""

import argparse
import shutil
import sys
from pathlib import Path

from mlx_diloco.blas import ensure_fast_blas

if __name__ == "__main__":
    ensure_fast_blas([__file__, *sys.argv[1:]])  # Linux: re-run with OpenBLAS preloaded

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from sklearn.datasets import load_digits

from mlx_diloco import DDP, SPARTA, DiLoCo, Trainer
from mlx_diloco.tools.plot import plot_runs


class MLP(nn.Module):
    def __init__(self, sizes=(64, 128, 128, 10)):
        super().__init__()
        self.layers = [nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:])]

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = nn.relu(layer(x))
        return self.layers[-1](x)


def loss_fn(model, x, y):
    return nn.losses.cross_entropy(model(x), y, reduction="mean")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300, help="inner steps per worker")
    p.add_argument("--out", default="runs/digits", help="folder for the runs and digits.png")
    args = p.parse_args()

    X, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(y))
    X, y = (X[order] / 16).astype(np.float32), y[order].astype(np.int32)
    train, test = (X[:1500], y[:1500]), (X[1500:], y[1500:])
    mx.random.seed(0)
    trainer = Trainer(MLP(), loss_fn, train, test, batch_size=16, lr=3e-3, warmup=20, eval_sequences=288,
                      eval_every=20, log=lambda m: None)

    strategies = {"ddp": DDP(compress="fp32"), "diloco": DiLoCo(sync_every=20),
                  "sparta": SPARTA(fraction=0.05)}
    out = Path(args.out)
    print(f"{'strategy':8} {'eval loss':>9} {'accuracy':>8} {'sent/worker':>12} {'1 GbE':>8} {'100 Mbit/s':>10}")
    for name, strategy in strategies.items():
        shutil.rmtree(out / name, ignore_errors=True)
        r = trainer.fit(strategy, workers=4, steps=args.steps, run_dir=out / name)
        accuracy = (mx.argmax(r.model(mx.array(test[0])), axis=1) == mx.array(test[1])).mean().item()
        print(f"{name:8} {r.summary['final_eval_loss']:>9.4f} {accuracy:>8.1%} {r.bytes_sent / 1e6:>9.2f} MB "
              f"{r.modelled_time('1gbe'):>6.1f} s {r.modelled_time('100mbit/20ms'):>8.1f} s")
    png = plot_runs([out / n for n in strategies], out / "digits.png",
                    title=f"MLP on digits, 4 workers, {args.steps} steps (DiLoCo H=20, SPARTA p=0.05)")
    print(f"plot: {png}")


if __name__ == "__main__":
    main()
