"""Peak memory of one worker, phase by phase, in a real run: for finding what makes a peak
(bench/memory.py gives the whole run's).

    python bench/memory_phases.py llama-1b bf16 grad_checkpoint=true moments_precision=bf16 \\
        offload_outer=true fragments=11

Arguments: a preset, a precision, then config keys and DiLoCo options as key=value. One worker,
batch 4 x 512, 2 steps with a sync after each (as docs/memory.md's 1B measurement). `Run.train` runs
as it is; each phase (the gradients, the inner step around them, the evaluations, the global
model, the sync, the checkpoint) resets MLX's peak when it starts and prints it when it ends,
nested phases indented (a phase's peak covers the phases nested in it).
"""

import functools
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
    from mlx_diloco.exchange.comm import SimCommunicator
    from mlx_diloco.gym.sweep import value
    from mlx_diloco.exchange.ledger import ExchangeLedger
    from mlx_diloco.training.run import Run
    from mlx_diloco.training.workers import Workers
    depth = [0]

    def report(name, started, indent):
        print(f"{'  ' * indent}{name:16} peak {mx.get_peak_memory() / 1e9:5.2f} GB, active after "
              f"{mx.get_active_memory() / 1e9:5.2f} GB, {time.time() - started:4.0f} s", flush=True)

    def measured(cls, name):
        method = getattr(cls, name)

        @functools.wraps(method)
        def run(*args, **kwargs):
            depth[0] += 1
            mx.reset_peak_memory()
            t = time.time()
            try:
                return method(*args, **kwargs)
            finally:
                report(name, t, depth[0])
                depth[0] -= 1
        setattr(cls, name, run)

    model, precision, *extra = sys.argv[1:]
    options = dict(model=model, workers=1, steps=2, sync_every=1, batch_size=4, seq_len=512, eval_sequences=4,
                   precision=precision)
    options.update({k: value(v) for k, v in (e.split("=", 1) for e in extra)})
    run = Run(TrainConfig.from_dict(options), tempfile.mkdtemp() + "/r", SimCommunicator(1), log=lambda m: None)
    for cls, names in [(Workers, ["_gradients", "step", "eval_each", "eval_params"]),
                       (type(run.strategy), ["global_params"]), (Run, ["save_checkpoint"])]:
        for name in names:
            measured(cls, name)
    # The sync, from the parameters handed to the outer step to what follows it: a wrapper around
    # after_step would hold the old parameters it is handed (Workers.take_params) and double it.
    take_params, record = Workers.take_params, ExchangeLedger.record
    started = []

    def sync_starts(self):
        mx.reset_peak_memory()
        started.append(time.time())
        return take_params(self)

    def sync_ended(self, *args, **kwargs):
        report("sync", started.pop(), 1)
        return record(self, *args, **kwargs)
    Workers.take_params, ExchangeLedger.record = sync_starts, sync_ended
    print(f"{model} {precision} {' '.join(extra)}: after setup active {mx.get_active_memory() / 1e9:.2f} GB, "
          f"peak {mx.get_peak_memory() / 1e9:.2f} GB", flush=True)
    run.train()


if __name__ == "__main__":
    main()
