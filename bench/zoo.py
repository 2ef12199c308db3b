"""Every strategy of the zoo on the strategy comparison's setting, at equal tokens.

    python bench/zoo.py [--steps 300] [--out runs/zoo]

Small GPT (1.12M), embedded Shakespeare, 4 workers, 16 x 64 tokens per worker per step, the same
inner steps for all: DDP, FedAvg, DiLoCo, Streaming DiLoCo (P = 5, tau = 1, int4), SPARTA, DeMo,
MuLoCo and SPARTA + DiLoCo (H = 30 where a strategy has one). One table: final eval loss of the
global model, bytes each worker sent, and the modelled wall-clock on 1 GbE and on 100 Mbit/s
(measured compute plus each exchange on that link, less what overlapped steps hide); zoo.png with
the curves. About 5 minutes per run on a 2-core CPU.
"""

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_diloco.blas import ensure_fast_blas  # noqa: E402

if __name__ == "__main__":
    ensure_fast_blas(sys.argv)

RUNS = {
    "ddp": dict(strategy="ddp"),
    "fedavg": dict(strategy="fedavg", sync_every=30),
    "diloco": dict(strategy="diloco", sync_every=30),
    "streaming": dict(strategy="diloco", sync_every=30, fragments=5, overlap_steps=1, compress="int4"),
    "sparta": dict(strategy="sparta", fraction=0.005),
    "demo": dict(strategy="demo"),
    "muloco": dict(strategy="muloco", sync_every=30),
    "sparta-diloco": dict(strategy="sparta-diloco", sync_every=30, fraction=0.005),
}
LINKS = {"1 GbE": "1gbe", "100 Mbit/s": "100mbit/20ms"}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300, help="inner steps per worker")
    p.add_argument("--out", default="runs/zoo", help="folder for the runs and zoo.png")
    p.add_argument("--only", help="comma-separated subset of: " + ", ".join(RUNS))
    args = p.parse_args()

    from mlx_diloco.exchange.comm import SimCommunicator
    from mlx_diloco.config import TrainConfig
    from mlx_diloco.exchange.network import modelled_time, parse_link
    from mlx_diloco.tools.plot import plot_runs
    from mlx_diloco.training.run import Run

    out = Path(args.out)
    names = args.only.split(",") if args.only else list(RUNS)
    common = dict(model="small", data="shakespeare", workers=4, steps=args.steps, eval_every=30, eval_sequences=256)
    print(f"{'strategy':14} {'eval loss':>9} {'sent/worker':>12} " + " ".join(f"{name:>11}" for name in LINKS))
    for name in names:
        shutil.rmtree(out / name, ignore_errors=True)
        config = TrainConfig.from_dict({**common, **RUNS[name]})
        run = Run(config, out / name, SimCommunicator(config.workers), log=lambda m: None)
        s = run.train()
        step_s = run.compute_s / run.steps_done
        times = [modelled_time(run.compute_s, run.ledger.log, step_s, parse_link(link)) for link in LINKS.values()]
        print(f"{name:14} {s['final_eval_loss']:>9.4f} {s['bytes_sent_per_worker'] / 1e6:>9.1f} MB "
              + " ".join(f"{t / 60:>7.1f} min" for t in times), flush=True)
    png = plot_runs([out / n for n in names], out / "zoo.png",
                    title=f"Strategy zoo: small GPT, 4 workers, {args.steps} steps, H=30")
    print(f"plot: {png}")


if __name__ == "__main__":
    main()
