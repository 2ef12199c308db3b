"""Peak memory of one worker, phase by phase: after setup, an inner step, an evaluation, a sync,
the evaluation of the global model. For finding what makes a peak (bench/memory.py gives the
whole run's).

    python bench/memory_phases.py llama-150m bf16 grad_checkpoint=true moments_precision=bf16 \\
        offload_outer=true fragments=6

Arguments: a preset, a precision, then config keys and DiLoCo options as key=value. One worker,
batch 4 x 512, a sync after step 2.
"""

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_diloco.blas import ensure_fast_blas  # noqa: E402

if __name__ == "__main__":
    ensure_fast_blas(sys.argv)


def main():
    import mlx.core as mx
    from mlx_diloco.config import TrainConfig
    from mlx_diloco.gym.sweep import value
    from mlx_diloco.exchange.comm import SimCommunicator
    from mlx_diloco.training.run import Run, memory_limit
    model, precision, *extra = sys.argv[1:]
    options = dict(model=model, workers=1, steps=4, sync_every=2, batch_size=4, seq_len=512, eval_batches=1,
                   precision=precision)
    options.update({k: value(v) for k, v in (e.split("=", 1) for e in extra)})
    run = Run(TrainConfig.from_dict(options), tempfile.mkdtemp() + "/r", SimCommunicator(1), log=lambda m: None)
    print(f"{model} {precision} {' '.join(extra)}: after setup active {mx.get_active_memory() / 1e9:.2f} GB, "
          f"peak {mx.get_peak_memory() / 1e9:.2f} GB", flush=True)
    x, y = run.next_batch()

    def phase(name, fn):
        mx.reset_peak_memory()
        t = time.time()
        fn()
        print(f"  {name:12} peak {mx.get_peak_memory() / 1e9:.2f} GB, active after "
              f"{mx.get_active_memory() / 1e9:.2f} GB, {time.time() - t:.0f} s", flush=True)

    def sync():
        run.workers.params = run.strategy.after_step(run.workers.take_params(), 2)
        mx.eval(run.workers.params)

    with memory_limit(run.config.memory_limit):  # as Run.train does
        phase("step 1", lambda: run.workers.step(x, y, run.strategy, 1))
        phase("eval", lambda: run.workers.eval_each(run.eval_batches).tolist())
        phase("step 2", lambda: run.workers.step(x, y, run.strategy, 2))
        phase("sync", sync)
        phase("global eval", lambda: run.workers.eval_params(run.global_params(), run.eval_batches))


if __name__ == "__main__":
    main()
