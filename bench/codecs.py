"""What each codec does to the values it carries, and what error feedback gets back (issue 20).

    python bench/codecs.py            (about a minute on a 2-core CPU; output: bench/results/codecs.txt)

1. Round trips of 8,192 values, one message: relative L2 error for normal(0, sigma) values at
   sigma = 1e-8 .. 1e4 and for Student-t (df = 2) heavy-tailed ones; rounding bias, how far
   sum(x_hat * sign(x)) falls from sum(|x|) (0 for unbiased rounding); non-finite values out of
   one 1e30 among normal ones; bytes per value, scales and unit included.
2. Error feedback: DiLoCo with H = 1, outer lr 1, no momentum, M workers, 4,096 values, 30 rounds
   of random pseudo-gradients, through the real Fragment and simulated exchange; the error of the
   global model against exact fp32 averaging, relative to the total step, with and without
   feedback, and their ratio (the issue's target: <= 0.3 at M = 3, 4, 8 for int4 and e3m0).
3. NoLoCo through a codec (issue 39: why it takes fp32 only): the outer step of two workers, the pair
   mean of their weights minus phi, through each codec against fp32, for 65,536 unit-scale weights
   that moved by 1e-2, 1e-3 and 1e-4 of their size.

Runs on any version of the package (it uses only Codec.roundtrip, wire_bytes, Fragment and the
simulator): copy it out of the tree and set PYTHONPATH to an older checkout to measure that one.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import mlx.optimizers as optim  # noqa: E402
import numpy as np  # noqa: E402

from mlx_diloco.exchange import codecs  # noqa: E402
from mlx_diloco.exchange.comm import SimCommunicator  # noqa: E402
from mlx_diloco.strategies.fragments import Fragment, Piece  # noqa: E402

SIGMAS = (1e-8, 1e-6, 1e-4, 1.0, 1e4)
N = 8192


def relative_error(codec, x: np.ndarray) -> float:
    out = np.array(codec.roundtrip(mx.array(x)[None]))[0]
    return float(np.linalg.norm(out - x) / np.linalg.norm(x))


def codec_row(codec) -> dict:
    rng = np.random.default_rng(0)
    z = rng.standard_normal(N).astype(np.float32)
    t = (z / np.sqrt(rng.chisquare(2, N) / 2)).astype(np.float32)   # Student-t, df = 2
    outlier = z.copy()
    outlier[N // 3] = 1e30
    decoded = np.array(codec.roundtrip(mx.array(z)[None]))[0]
    return {"errors": [relative_error(codec, (z * s).astype(np.float32)) for s in SIGMAS],
            "student_t": relative_error(codec, t),
            "bias": float((decoded * np.sign(z)).sum() / np.abs(z).sum() - 1),   # E[x_hat sign x] / E|x| - 1
            "non_finite": int((~np.isfinite(np.array(codec.roundtrip(mx.array(outlier)[None])))).sum()),
            "bytes": codec.wire_bytes(N) / N}


def cumulative_error(codec_name: str, M: int, feedback: bool, rounds: int = 30, n: int = 4096) -> float:
    """||global model - exact one|| / ||exact total step|| after `rounds` outer steps (lr 1, no momentum)."""
    comm = SimCommunicator(M)
    fragment = Fragment(0, [Piece("w", 0, n)], mx.zeros(n), optim.SGD(learning_rate=1.0), sync_every=1,
                        offset=0, delay=0, alpha=0.0, codec=codecs.get_codec(codec_name),
                        error_feedback=feedback, n_local=M)
    exact = np.zeros(n, np.float32)
    for t in range(rounds):
        delta = mx.random.normal((M, n), key=mx.random.key(1000 * M + t)) * 0.01
        flat = {"w": fragment.global_values[None] - delta}   # each worker's local model after its round
        fragment.prepare_sync(flat, comm, step=t + 1)
        fragment.perform_sync(flat)
        exact -= np.array(delta).mean(axis=0)
    return float(np.linalg.norm(np.array(fragment.global_values) - exact) / np.linalg.norm(exact))


def noloco_step_error(codec_name: str, moved: float, n: int = 65536) -> float:
    """||step through the codec - exact step|| / ||exact step||, NoLoCo's step mean(theta) - phi."""
    rng = np.random.default_rng(0)
    phi = rng.standard_normal(n).astype(np.float32)
    theta = mx.array(phi + moved * rng.standard_normal((2, n)).astype(np.float32))
    comm = SimCommunicator(2)
    exact, lossy = (comm.start_pair_mean(theta, [1, 0], name).result() - phi for name in ("fp32", codec_name))
    return float(mx.linalg.norm(lossy - exact) / mx.linalg.norm(exact))


def main():
    names = list(codecs.CODECS) + list(getattr(codecs, "VARIANTS", {}))
    default = getattr(codecs, "DEFAULT_ROUNDING", "nearest")  # (the starting code had one rounding for all)
    if isinstance(default, dict):
        default = ", ".join(f"{name} {rounding}" for name, rounding in default.items())
    print(f"1. round trips of {N:,} values (one message); a plain name rounds by default ({default})")
    print(f"{'codec':16}" + "".join(f"{f's={s:g}':>9}" for s in SIGMAS)
          + f"{'t(df=2)':>9}{'bias':>9}{'1e30:NaN':>9}{'B/value':>9}")
    for name in names:
        r = codec_row(codecs.get_codec(name))
        print(f"{name:16}" + "".join(f"{e:>9.4f}" for e in r["errors"])
              + f"{r['student_t']:>9.4f}{r['bias']:>+9.2%}{r['non_finite']:>9}{r['bytes']:>9.4f}", flush=True)

    print("\n2. error feedback: cumulative error of the global model after 30 rounds (H=1, outer lr 1, no momentum)")
    print(f"{'codec':16}{'M':>3}{'without':>10}{'with':>10}{'ratio':>8}")
    ef_names = ["int4", "e3m0", "int2"] + [f"{n}-{r}" for n in ("int4", "e3m0", "int2") for r in ("nearest", "stochastic")
                                           if f"{n}-{r}" in names]
    for name in ef_names:
        for M in (2, 3, 4, 8):
            without, with_ = cumulative_error(name, M, False), cumulative_error(name, M, True)
            print(f"{name:16}{M:>3}{without:>10.4f}{with_:>10.4f}{with_ / without:>7.2f}x", flush=True)

    moved = (1e-2, 1e-3, 1e-4)
    print("\n3. NoLoCo: error of the outer step of unit-scale weights that moved by a share of their size, per codec")
    print(f"{'codec':16}" + "".join(f"{f'moved {m:g}':>14}" for m in moved))
    for name in ("bf16", "fp16", "int8", "int4"):
        print(f"{name:16}" + "".join(f"{noloco_step_error(name, m):>14.1%}" for m in moved), flush=True)


if __name__ == "__main__":
    main()
