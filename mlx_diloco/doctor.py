"""`mlx-diloco doctor`: what a user needs to know about this machine before training."""

import os
import platform
import sys
import time

from . import __version__, blas
from .cluster import hostinfo


def matmul_gflops(n: int = 1024, repeats: int = 3) -> float:
    import mlx.core as mx
    a = mx.random.normal((n, n))
    mx.eval(a @ a)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(a @ a)
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best / 1e9


def report() -> list:
    import mlx.core as mx
    lines = [f"mlx-diloco {__version__}, Python {sys.version.split()[0]}, {platform.platform()}",
             f"mlx {mx.__version__}, default device {mx.default_device()}",
             f"memory: {hostinfo.memory_bytes() / 1e9:.1f} GB, CPU cores: {os.cpu_count()}"]
    if mx.metal.is_available():
        info = mx.metal.device_info()
        lines.append(f"Metal GPU: {info.get('device_name', '?')}, "
                     f"recommended working set {info.get('max_recommended_working_set_size', 0) / 1e9:.1f} GB")
    gflops = matmul_gflops()
    lines.append(f"matmul 1024x1024 float32: {gflops:.1f} GFLOP/s")
    if sys.platform.startswith("linux"):
        if blas.openblas_preloaded():
            lines.append("BLAS: OpenBLAS preloaded (fast path)")
        else:
            lines.append(f"BLAS: MLX's bundled reference BLAS (~40x slow matmul); fix: {blas.FIX}")
    backends = [b for b in ("ring", "mpi", "jaccl", "nccl") if _backend_available(mx, b)]
    lines.append(f"distributed backends: {', '.join(backends) or 'none'}")
    return lines


def _backend_available(mx, backend: str) -> bool:
    try:
        return bool(mx.distributed.is_available(backend))
    except (TypeError, ValueError):
        return False
