"""How long the exchange's codecs take on the CPU (where every exchange runs, on a Mac too: comm.py's
stream): one worker's encode, the decode of M workers' messages, and the simulator's whole mean of
M workers (check, encode, gather or quantized ring, decode), for one fragment of the emulated
cluster's Streaming DiLoCo (gpt-10m in 3 fragments: 4.7M values). Best of --repeats, in ms.

    python bench/codec_speed.py [--values 4700000] [--base CHECKOUT]

`--base`: the same, measured on another checkout's package in the same run (each side in its own
process, alternating), with the ratio base / here. Take timings on a quiet machine.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CODECS = ("fp16", "int8", "int4", "int2", "e3m0")
WORKERS = (2, 4)


def best_ms(f, repeats: int) -> float:
    import mlx.core as mx
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(f())
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def measure(values: int, repeats: int) -> dict:
    """{codec: {what: ms}} of the package on sys.path."""
    import mlx.core as mx
    from mlx_diloco.exchange.codecs import get_codec
    from mlx_diloco.exchange.comm import SimCommunicator
    x = mx.random.normal((max(WORKERS), values), key=mx.random.key(0)) * 0.01
    mx.eval(x)
    rows = {}
    for name in CODECS:
        codec = get_codec(name)
        wire = codec.encode(x[:2], salt=mx.arange(2))
        mx.eval(wire)
        row = {"encode x1": best_ms(lambda: codec.encode(x[:1], salt=mx.arange(1)), repeats),
               "decode x2": best_ms(lambda: codec.decode(wire, values), repeats)}
        for M in WORKERS:
            row[f"mean M={M}"] = best_ms(lambda: SimCommunicator(M).start_mean(x[:M], name).result(), repeats)
        rows[name] = row
    return rows


def child(checkout: str, args) -> dict:
    env = {**os.environ, "PYTHONPATH": checkout}
    out = subprocess.run([sys.executable, __file__, "--child", "--values", str(args.values), "--repeats",
                          str(args.repeats)], env=env, cwd=checkout, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--values", type=int, default=4_700_000, help="values per worker")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--base", help="another checkout, measured beside this one")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    from mlx_diloco.blas import ensure_fast_blas
    ensure_fast_blas([__file__, *sys.argv[1:]])
    if args.child:
        print(json.dumps(measure(args.values, args.repeats)))
        return
    sides = {"here": str(ROOT)} | ({"base": str(Path(args.base).resolve())} if args.base else {})
    results = {side: child(path, args) for side, path in sides.items()}
    print(f"{args.values:,} values per worker; best of {args.repeats}; ms"
          + (f"; base: {sides['base']}" if args.base else ""))
    whats = list(results["here"][CODECS[0]])
    print(f"{'codec':<6}" + "".join(f"{w:>12}" + (f"{'base':>9}{'ratio':>7}" if args.base else "") for w in whats))
    for name in CODECS:
        line = f"{name:<6}"
        for w in whats:
            line += f"{results['here'][name][w]:>12.1f}"
            if args.base:
                b = results["base"][name][w]
                line += f"{b:>9.1f}{b / results['here'][name][w]:>7.2f}"
        print(line)


if __name__ == "__main__":
    main()
