"""Issue 36, item 6: the spike in the dashboard's launch picture (bench/results/dashboard-launch.png:
3 hosts, tiny, H = 15, worker 1 killed near step 44, the global eval loss 6.7 at step 75 against 5.2 at
steps 60 and 90). Is the global model wrong, or only its evaluation, and is the recovery the cause?

The same job simulated without any failure, at every sync: the global model's eval loss (as the run
reports it, and on held-out batches the run's evaluation does not use), the mean of the workers'
models before the outer step, and the sizes of the pseudo-gradient and of the outer update; with
DiLoCo's defaults (Nesterov, outer momentum 0.9, outer lr 0.7), without outer momentum, and at half
the outer lr.

    .venv/bin/python bench/outer_overshoot.py        # about a minute on a 2-core machine
"""

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from mlx_diloco.blas import ensure_fast_blas  # noqa: E402

ensure_fast_blas([sys.argv[0], *sys.argv[1:]])

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten, tree_unflatten  # noqa: E402

from conftest import tiny_config  # noqa: E402  (the dashboard test's config, as the test builds it)
from mlx_diloco.exchange.comm import SimCommunicator  # noqa: E402
from mlx_diloco.training.run import Run  # noqa: E402

H, STEPS = 15, 120
VARIANTS = {"defaults (outer momentum 0.9, outer lr 0.7)": {}, "outer momentum 0": {"outer_momentum": 0.0},
            "outer lr 0.35": {"outer_lr": 0.35}}


def flat(tree) -> dict:
    return {k: np.array(v) for k, v in tree_flatten(tree)}


def syncs(options: dict, folder: Path) -> list:
    """One line per sync of the dashboard test's job, simulated uninterrupted with `options`."""
    config = tiny_config(workers=3, steps=240, sync_every=H, seq_len=32, batch_size=8, compress="fp32", **options)
    run = Run(config, folder, SimCommunicator(3), log=lambda m: None, callbacks=[])
    other = run.data.eval_batches(config.batch_size, config.eval_batches + 6)[config.eval_batches:]
    seen, outer_step = {}, run.strategy.after_step

    def after_step(params, step):  # the workers' models and the global one, before the outer step
        if step % H == 0:
            seen.update(workers=flat(params), before=flat(run.strategy.global_params(None)))
        return outer_step(params, step)
    run.strategy.after_step = after_step
    loss = lambda params, batches: run.workers.eval_params(tree_unflatten([(k, mx.array(v)) for k, v in params.items()]),
                                                           batches)
    lines = []
    while run.steps_done < STEPS:
        run.train(stop_after=run.steps_done + H)
        now, before = flat(run.strategy.global_params(None)), seen["before"]
        mean = {k: v.mean(axis=0) for k, v in seen["workers"].items()}
        norm = lambda a, b: np.sqrt(sum(((a[k] - b[k]) ** 2).sum() for k in a))
        lines.append(f"  step {run.steps_done:3d}: global {loss(now, run.eval_batches):.3f} (other held-out batches "
                     f"{loss(now, other):.3f}), mean of the workers {loss(mean, run.eval_batches):.3f}; "
                     f"|pseudo-gradient| {norm(before, mean):.3f}, |outer update| {norm(now, before):.3f}")
    return lines


def main():
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, options) in enumerate(VARIANTS.items()):
            print(f"{name}:", *syncs(options, Path(tmp) / str(i)), sep="\n", flush=True)


if __name__ == "__main__":
    main()
