"""Streaming DiLoCo's codecs: the bytes each one sends, and the loss each one reaches.

    python bench/streaming.py [--steps 500] [--out runs/streaming] [--bytes-only]

1. Bytes (no training): for the small GPT's 1.12M parameters, the payload one worker contributes
   per sync (bytes per parameter, scales included) and what each worker sends at M = 2, 4 and 8,
   counted by the simulator's byte accounting of a real exchange.
2. Loss: the strategy comparison's setting (small GPT, embedded Shakespeare, 4 workers, H = 50,
   500 steps): plain DiLoCo with an fp32 exchange, then Streaming DiLoCo (P = 4, tau = 1,
   alpha = 0.5) with each codec, and int2 with error feedback. Final eval loss of the global model,
   its ratio to plain DiLoCo fp32 against the issue's targets, bytes sent per worker and the largest
   single exchange; streaming.png with every curve. About 7 minutes per run on a 2-core CPU.
3. Rounding: the same streaming runs for int4, e3m0 and int2 with each rounding named
   (codec-nearest, codec-stochastic; the plain codec name is the default rounding), e.g.
   --only streaming-e3m0-nearest,streaming-e3m0-stochastic.
"""

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mlx_diloco.blas import ensure_fast_blas  # noqa: E402

if __name__ == "__main__":
    ensure_fast_blas(sys.argv)

CODECS = ["fp32", "fp16", "bf16", "int8", "int4", "e3m0", "int2"]
TARGETS = {"int8": 0.005, "int4": 0.01, "e3m0": 0.01, "int2+ef": 0.01}  # relative to plain DiLoCo fp32


def bytes_table(params: int):
    import mlx.core as mx
    from mlx_diloco.exchange.codecs import CODECS as REGISTRY
    from mlx_diloco.exchange.comm import SimCommunicator

    print(f"bytes per sync for {params:,} parameters (one worker; scales included)")
    print(f"{'codec':6} {'payload B/param':>15} " + " ".join(f"{f'sent M={M}':>14}" for M in (2, 4, 8))
          + "  algorithm at M=2/4/8")
    for name in CODECS:
        sent, algorithms = [], []
        for M in (2, 4, 8):
            comm = SimCommunicator(M)
            comm.start_mean(mx.zeros((M, params)), name).result()
            (record,) = comm.drain_records()
            sent.append(record.sent_bytes / params)
            algorithms.append(record.algorithm)
        payload = REGISTRY[name].wire_bytes(params) / params
        print(f"{name:6} {payload:>15.4f} " + " ".join(f"{s:>11.4f} B/p" for s in sent) + "  " + "/".join(algorithms))
    print("4-bit bound 2(M-1)/M x 0.55:  " + "  ".join(f"M={M}: {2 * (M - 1) / M * 0.55:.4f}" for M in (2, 4, 8)))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/streaming", help="folder for the runs and the plot")
    p.add_argument("--steps", type=int, default=500, help="inner steps per worker")
    p.add_argument("--sync-every", type=int, default=50, help="H")
    p.add_argument("--bytes-only", action="store_true", help="only the bytes table (seconds)")
    p.add_argument("--model", default="small", help="model preset (the bytes table is for the small GPT)")
    p.add_argument("--fragments", type=int, default=4, help="P of the streaming runs")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    p.add_argument("--only", help="comma-separated subset of the runs, e.g. diloco-fp32,streaming-int4")
    args = p.parse_args()

    from compare_strategies import comparison_settings, train
    from mlx_diloco.tools.plot import plot_runs

    bytes_table(1_123_712)
    if args.bytes_only:
        return
    out = Path(args.out)
    common = {**comparison_settings(args.steps, args.sync_every), "workers": 4, "strategy": "diloco",
              "model": args.model, "seq_len": args.seq_len}
    streaming = dict(fragments=args.fragments, overlap_steps=1, merge_alpha=0.5)
    runs = {"diloco-fp32": dict(compress="fp32")}
    runs.update({f"streaming-{c}": dict(streaming, compress=c) for c in CODECS if c != "bf16"})
    runs["streaming-int2+ef"] = dict(streaming, compress="int2", error_feedback=True)
    for c in ("int4", "e3m0", "int2"):
        runs.update({f"streaming-{c}-{r}": dict(streaming, compress=f"{c}-{r}") for r in ("nearest", "stochastic")})
    if args.only:
        runs = {name: runs[name] for name in args.only.split(",")}
    results = {}
    for name, overrides in runs.items():
        shutil.rmtree(out / name, ignore_errors=True)
        results[name] = train({**common, **overrides}, out / name)
        s = results[name]
        print(f"{name:20} eval loss {s['final_eval_loss']:.4f}  sent {s['bytes_sent_per_worker'] / 1e6:.2f} MB  "
              f"largest exchange {s['peak_exchange_bytes'] / 1e6:.3f} MB", flush=True)

    base = results.get("diloco-fp32")
    if base is None:
        return
    print(f"\n{'run':20} {'eval loss':>9} {'vs DiLoCo fp32':>14} {'target':>8} {'sent/worker':>12} {'largest exchange':>17}")
    for name, s in results.items():
        rel = s["final_eval_loss"] / base["final_eval_loss"] - 1
        codec = name.split("-", 1)[1]
        target = TARGETS.get(codec.removesuffix("-nearest").removesuffix("-stochastic"))
        verdict = "" if target is None else f"{'met' if rel <= target else 'NOT met'} ({target:.1%})"
        print(f"{name:20} {s['final_eval_loss']:>9.4f} {rel:>+13.2%} {verdict:>8} "
              f"{s['bytes_sent_per_worker'] / 1e6:>9.2f} MB {s['peak_exchange_bytes'] / base['peak_exchange_bytes']:>12.3f} x plain")
    png = plot_runs([out / n for n in runs], out / "streaming.png",
                    title=f"Streaming DiLoCo codecs: {args.model}, 4 workers, H={args.sync_every}, P={args.fragments}, tau=1")
    print(f"plot: {png}")


if __name__ == "__main__":
    main()
