"""Peak memory of one DiLoCo worker, measured beside `plan`'s estimate.

    python bench/memory.py [--models small gpt-10m llama-150m llama-1b] [--steps 2]
    python bench/memory.py --models llama-1b llama-1b-4bit --fine-tune-type lora --shape 2x256 --cases fp32 bf16

Each case is `mlx-diloco sim --workers 1 --processes 1` in its own process (MLX's peak memory is
per process) for a few steps with a sync every step: by default fp32, with checkpointing, bf16 with
it, and the leanest (bf16 moments, the outer state offloaded); --cases picks (bf16: without
checkpointing). --fine-tune-type lora (or dora) trains adapters on the frozen base (a 4-bit preset:
QLoRA); --shape sets the batch for every model. A case whose estimate exceeds this machine's memory
is shown, not run. Extra sim flags for every case after --extra (e.g. --fragments 11).
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mlx_diloco.cluster.hostinfo import memory_bytes  # noqa: E402
from mlx_diloco.config import TrainConfig  # noqa: E402
from mlx_diloco.machine.memory import GB, macs_it_fits, worker_estimate  # noqa: E402
from mlx_diloco.strategies import DiLoCo  # noqa: E402

SHAPES = {"small": (16, 64), "gpt-10m": (16, 256), "llama-150m": (4, 512), "llama-1b": (4, 512)}
# name: (precision, moments precision, checkpointing, offloaded outer state)
CASES = {"fp32": ("fp32", "fp32", False, False), "fp32-ckpt": ("fp32", "fp32", True, False),
         "bf16-ckpt": ("bf16", "fp32", True, False), "lean": ("bf16", "bf16", True, True),
         "bf16": ("bf16", "fp32", False, False)}
DEFAULT_CASES = ["fp32", "fp32-ckpt", "bf16-ckpt", "lean"]


def measure(model, fine_tune_type, batch, seq_len, precision, moments, ckpt, offload, steps, extra):
    with tempfile.TemporaryDirectory() as tmp:
        args = [sys.executable, "-m", "mlx_diloco", "sim", "--model", model, "--workers", "1", "--processes", "1",
                "--steps", str(steps), "--sync-every", "1", "--batch-size", str(batch), "--seq-len", str(seq_len),
                "--eval-sequences", str(batch), "--sample-tokens", "0", "--precision", precision,
                "--moments-precision", moments, "--fine-tune-type", fine_tune_type, "--run-dir", f"{tmp}/r", *extra]
        args += ["--grad-checkpoint"] * ckpt + ["--offload-outer"] * offload
        t = time.time()
        out = subprocess.run(args, capture_output=True, text=True, cwd=ROOT)
        if out.returncode:
            return None, out.stderr.strip().splitlines()[-1]
        return json.loads(Path(f"{tmp}/r/summary.json").read_text())["peak_memory_bytes"], f"{time.time() - t:.0f} s"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(SHAPES))
    p.add_argument("--fine-tune-type", default="full", choices=["full", "lora", "dora"])
    p.add_argument("--shape", help="batch x sequence length for every model, e.g. 2x256 (default: per model)")
    p.add_argument("--cases", nargs="+", default=DEFAULT_CASES, choices=list(CASES))
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more sim flags for every case")
    args = p.parse_args()
    machine = memory_bytes()
    print(f"{'model':14} {'params':>8} {'trains':>8} {'B x T':>8} {'precision':9} {'moments':7} {'ckpt':4} {'offload':7} "
          f"{'measured':>9} {'estimate':>9} {'est/meas':>8} {'B/param':>7}  fits Macs (GB)  time")
    for name in args.models:
        batch, seq_len = map(int, args.shape.split("x")) if args.shape else SHAPES.get(name, (4, 512))
        for case in args.cases:
            precision, moments, ckpt, offload = CASES[case]
            config = TrainConfig(model=name, batch_size=batch, seq_len=seq_len, precision=precision,
                                 moments_precision=moments, grad_checkpoint=ckpt, fine_tune_type=args.fine_tune_type)
            _, shape, est = worker_estimate(config, DiLoCo(offload_outer=offload))
            n, est = shape.parameters, est["total"]
            if est > 0.85 * machine:
                peak, note = None, "not run: larger than this machine"
            else:
                peak, note = measure(name, args.fine_tune_type, batch, seq_len, precision, moments, ckpt, offload,
                                     args.steps, args.extra)
            trains = "all" if shape.trainable is None else f"{shape.trainable / 1e6:.2f}M"
            row = (f"{name:14} {n / 1e6:7.1f}M {trains:>8} {f'{batch}x{seq_len}':>8} {precision:9} {moments:7} "
                   f"{'yes' if ckpt else 'no':4} {'yes' if offload else 'no':7} "
                   f"{f'{peak / GB:.2f} GB' if peak else '-':>9} {est / GB:6.2f} GB "
                   f"{f'{est / peak:.2f}' if peak else '-':>8} {f'{(peak or est) / n:.1f}':>7}  "
                   f"{','.join(map(str, macs_it_fits(peak or est))) or 'none':14}  {note}")
            print(row, flush=True)


if __name__ == "__main__":
    main()
