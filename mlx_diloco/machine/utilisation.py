"""How much of a device's peak a run uses: model FLOPs utilisation (MFU), and the device's peak.

    MFU = FLOPs per token x tokens per second / the device's peak FLOP/s

FLOPs per token from the model's shape, as PaLM (appendix B) counts a training step: 6 per weight
of a matrix multiply (2 forward, 2 for the input's gradient, 2 for the weight's) and 12 L d T for
attention over T positions; a frozen weight (fine-tuning with adapters) costs 4, having no gradient
of its own. The embedding is a lookup, not a multiply; a head tied to it is counted once, as a
multiply. The peak is what `doctor` measures (matmul GFLOP/s in float32), kept per machine
in a small cache so runs do not measure it while they train. A measurement taken while other work
runs reads low, and a low peak makes an MFU above 100%: the cache keeps the best measurement, and a
run whose own rate beats the kept peak measures it again and keeps the best of the two and its rate.

MLX-free at import (MLX imported on call): `plan` and the launcher use the formulas. And when this
process started, the wall-clock a run's time split divides (training/clock.py).
"""

import json
import os
import platform
import time
from pathlib import Path

from ..atomic import atomic_write_text

_IMPORTED_AT = time.time()


def process_start() -> float:
    """When this process started (Unix time): the kernel's count on Linux (10 ms ticks); elsewhere (macOS)
    when this module was first imported (the interpreter's start and the imports before it, about a
    second, go uncounted)."""
    try:
        since_boot = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return min(time.time() - (uptime - since_boot), _IMPORTED_AT)
    except (OSError, ValueError, IndexError):
        return _IMPORTED_AT


def flops_per_token(shape, seq_len: int, tied_head: bool = True):
    """Training FLOPs per token of a transformer of memory.Shape `shape` (None for a model that is
    not one: an image model's convolutions depend on its image size, not its weights)."""
    if not shape.blocks or not shape.hidden or not shape.vocab:
        return None
    multiplied = shape.parameters - (0 if tied_head else shape.vocab * shape.hidden)  # the lookup is free
    trainable = multiplied if shape.trainable is None else shape.trainable
    frozen = multiplied if shape.trainable is not None else 0
    return 6 * trainable + 4 * frozen + 12 * shape.blocks * shape.hidden * seq_len


def mfu(flops_per_token, tokens_per_s: float, peak_gflops: float):
    """The share of the device's peak a throughput uses (None when either is unknown)."""
    if not flops_per_token or not peak_gflops:
        return None
    return flops_per_token * tokens_per_s / (peak_gflops * 1e9)


def matmul_gflops(n: int = 1024, repeats: int = 10) -> float:
    """The best of `repeats` float32 n x n matrix multiplies, in GFLOP/s (the best: the one least
    slowed by other work on the machine)."""
    import mlx.core as mx
    a = mx.random.normal((n, n))
    mx.eval(a @ a)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(a @ a)
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best / 1e9


def _cache_path() -> Path:
    from ..data.datasets import cache_root  # ~/.cache/mlx-diloco, or $MLX_DILOCO_CACHE
    return cache_root() / "peak-gflops.json"


def _machine_key() -> str:
    """What decides the peak: the machine, MLX's device and version, and the BLAS threads allowed
    (sim's processes and the emulated cluster's hosts each get a share of the cores: their peak)."""
    import mlx.core as mx
    return (f"{platform.node()} {platform.machine()} mlx {mx.__version__} {mx.default_device()} "
            f"threads {os.environ.get('OPENBLAS_NUM_THREADS', 'all')}")


def peak_gflops(beaten_by: float = 0.0) -> float:
    """This machine's matmul GFLOP/s, the best measured: from the cache; measured when it holds none,
    or when `beaten_by` (GFLOP/s: a run's own rate, doctor's measurement) beats it, and then kept as
    the best of the two and the new measurement. Processes that start together measure one at a time."""
    import fcntl
    path, key = _cache_path(), _machine_key()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            known = json.loads(path.read_text())
        except (OSError, ValueError):
            known = {}
        kept = known.get(key, 0.0)
        if not kept or beaten_by > kept:
            known[key] = max(kept, matmul_gflops(), beaten_by)
            atomic_write_text(path, json.dumps(known, indent=1))
        return known[key]
