"""Make MLX's CPU backend fast on Linux.

The Linux `mlx[cpu]` wheel bundles a reference BLAS whose matmul is ~40x slower than
OpenBLAS. Preloading Debian's OpenBLAS replaces it. `ensure_fast_blas()` re-executes the
current command with that preload when the library is installed, and otherwise warns once
with the fix. It must run before `mlx` is imported.
"""

import os
import sys

OPENBLAS_CANDIDATES = [
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
]
FIX = "install OpenBLAS (Debian/Ubuntu: sudo apt-get install libopenblas0-pthread)"
_SKIP_ENV = "MLX_DILOCO_NO_BLAS_FIX"


def find_openblas():
    return next((p for p in OPENBLAS_CANDIDATES if os.path.exists(p)), None)


def openblas_preloaded():
    return "openblas" in os.environ.get("LD_PRELOAD", "")


def ensure_fast_blas(argv=None):
    """On Linux, re-exec with OpenBLAS preloaded if possible; otherwise warn.

    `argv` is the command line to re-run: by default `python -m mlx_diloco ARGS`; a script
    passes `[sys.argv[0], *sys.argv[1:]]` to be re-run as itself."""
    if not sys.platform.startswith("linux") or openblas_preloaded() or os.environ.get(_SKIP_ENV):
        return
    lib = find_openblas()
    if lib is None:
        print(f"warning: MLX matmul runs ~40x slow on Linux without OpenBLAS; {FIX}", file=sys.stderr)
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(filter(None, [lib, env.get("LD_PRELOAD")]))
    env[_SKIP_ENV] = "1"  # never loop, even if the preload is dropped
    command = ["-m", "mlx_diloco", *sys.argv[1:]] if argv is None else list(argv)
    os.execve(sys.executable, [sys.executable, *command], env)
