"""Streaming DiLoCo on a real (emulated) 2-host cluster at 100 Mbit/s: compute utilisation of
DiLoCo with an fp16 exchange and of Streaming DiLoCo with int4 (tau = 1 and tau = 5), at the same
H, side by side, next to the network model's prediction for each; and where every second of each
run went (records.TIME: rank 0's split of its wall-clock, the launcher's of the job's).

The model (gpt-10m, 4 x 64 tokens a step) is large enough that one full fp16 sync (28 MB) takes
several inner steps at 100 Mbit/s. Needs root (network namespaces; see cluster/netns-cluster.sh).
`--base CHECKOUT`: the same runs with another checkout's package (its agents, launcher and
workers, on a cluster of their own), alternating with this one's, run by run.

    sudo .venv/bin/python bench/cluster_streaming.py      # ~10 minutes on a 2-core machine
    sudo .venv/bin/python bench/cluster_streaming.py --base /work/base-eb140cf --repeats 2

--keep FOLDER keeps every host's job folders (workers' logs, exchanges.jsonl of rank 0) for a look
at single exchanges.
"""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from mlx_diloco.blas import ensure_fast_blas  # noqa: E402


def split_line(what: str, record: dict) -> str:
    """'  rank 0: wall-clock 95.2 s, parts sum 99.6%: compute 80.1%, ...' (records.TIME) of a row or summary."""
    from mlx_diloco.records import TIME_NAMES
    split, wall = record.get("time_s"), record.get("process_s")
    if not split or not wall:
        return f"  {what}: no time split (a checkout from before it)"
    parts = ", ".join(f"{TIME_NAMES[k]} {s / wall:.1%}" for k, s in split.items() if s)
    return f"  {what}: wall-clock {wall:.1f} s, the parts sum to {sum(split.values()) / wall:.1%}: {parts}"


def older_flag(flag: str) -> str:
    """A flag as a checkout from before --eval-sequences reads it (--eval-batches of 4 sequences)."""
    return f"--eval-batches={int(flag.split('=')[1]) // 4}" if flag.startswith("--eval-sequences=") else flag


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-10m", help="model preset")
    p.add_argument("--sync-every", type=int, default=30, help="H")
    p.add_argument("--steps", type=int, default=90, help="inner steps of each run")
    p.add_argument("--fragments", type=int, default=3, help="P for the streaming runs")
    p.add_argument("--rate", default="100mbit", help="each host's link (tc rate)")
    p.add_argument("--runs", nargs="+", help="only these runs (default: all three)")
    p.add_argument("--base", help="another checkout: its runs alternate with this one's")
    p.add_argument("--repeats", type=int, default=1, help="runs of each setup (alternating with --base's)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "cluster_streaming.txt"))
    p.add_argument("--keep", help="a folder to keep the runs in (each host's job folders, logs included)")
    args = p.parse_args()
    ensure_fast_blas([__file__, *sys.argv[1:]])
    from cluster_links import run_job, save_table
    from mlx_diloco.cluster.emulated import EmulatedCluster, can_build
    if why := can_build():
        raise SystemExit(f"cannot build the emulated cluster: {why}")

    base = [f"--model={args.model}", "--workers=2", "--seq-len=64", "--batch-size=4", "--eval-sequences=8",
            "--warmup=10", f"--sync-every={args.sync_every}", f"--steps={args.steps}", f"--eval-every={args.steps}",
            f"--link={args.rate}/0.05ms"]
    runs = {"DiLoCo fp16": ["--compress=fp16"],
            "Streaming int4 tau=1": ["--compress=int4", f"--fragments={args.fragments}", "--overlap-steps=1"],
            "Streaming int4 tau=5": ["--compress=int4", f"--fragments={args.fragments}", "--overlap-steps=5"]}
    runs = {k: v for k, v in runs.items() if not args.runs or k in args.runs}
    checkouts = {"here": str(ROOT), **({"base": str(Path(args.base).resolve())} if args.base else {})}
    lines = [f"2 hosts at {args.rate}, model {args.model}, 4x64 tokens a step, H={args.sync_every}, {args.steps} steps; "
             f"streaming: P={args.fragments}" + (f"; here: {ROOT}, base: {checkouts['base']}" if args.base else ""),
             f"{'run':22} {'code':5} {'compute/step':>13} {'exchanges':>9} {'largest':>9} {'blocked/exchange':>17} "
             f"{'modelled/exchange':>18} {'util (measured)':>16} {'util (modelled)':>16} {'compute/wall':>13} {'wall':>8}"]
    print(lines[0], flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        tmp = args.keep or scratch
        clusters = {}
        try:
            for name, root in checkouts.items():  # each checkout's own agents (PYTHONPATH: its package)
                clusters[name] = EmulatedCluster(2, Path(tmp) / f"c-{name}", rate=args.rate,
                                                 host_env={i: {"PYTHONPATH": root} for i in (1, 2)}, mdns=False)
            for repeat in range(args.repeats):
                for name, flags in runs.items():
                    for code, root in checkouts.items():
                        cluster = clusters[code]
                        folder = name.split()[0].lower() + "-" + "-".join(f.split("=")[1] for f in flags) + f"-{repeat}"
                        knows = "eval_sequences" in (Path(root) / "mlx_diloco" / "config.py").read_text()
                        given = base if knows else [older_flag(f) for f in base]
                        row = run_job(cluster, Path(tmp) / code, folder, given + flags, env={"PYTHONPATH": root})
                        (log,) = cluster.folder.glob(f"host*/jobs/{folder}-*/worker-*/exchanges.jsonl")  # rank 0's
                        exchanges = [json.loads(line) for line in log.read_text().splitlines()]
                        n = len(exchanges)
                        line = (f"{name:22} {code:5} {row['compute_s'] / args.steps * 1e3:>10.1f} ms {n:>9} "
                                f"{row['peak_exchange_bytes'] / 1e6:>6.2f} MB "
                                f"{sum(e['blocked_s'] for e in exchanges) / n * 1e3:>14.1f} ms "
                                f"{sum(e['modelled_s'] for e in exchanges) / n * 1e3:>15.1f} ms "
                                f"{row['measured_utilisation']:>16.1%} {row['utilisation']:>16.1%} "
                                f"{row['compute_s'] / row['wall_s']:>13.1%} {row['wall_s']:>6.1f} s")
                        summary = json.loads((Path(tmp) / code / folder / "summary.json").read_text())
                        print(line, flush=True)
                        lines.append(line)
                        if code == "here":
                            for extra in (split_line("rank 0's last row", row), split_line("the job (launcher)", summary)):
                                print(extra, flush=True)
                                lines.append(extra)
        finally:
            for cluster in clusters.values():
                cluster.close()
    save_table(lines + [
        "blocked/exchange: rank 0's measured time blocked per exchange (starting it and waiting for its",
        "  result; includes waiting for the slower peer); modelled/exchange: the network model's time.",
        "util (measured): compute / (compute + blocked); util (modelled): compute / (compute + the",
        "  modelled exchange time that the overlapped steps do not hide); compute/wall: rank 0's compute",
        "  over the wall-clock time since its process started the run (saves, evaluation included); wall:",
        "  that wall-clock, the outcome (a share moves with the step's speed too: a faster step lowers",
        "  compute/wall at the same wall-clock).",
        "rank 0's last row, the job: where the wall-clock went (records.TIME), as shares of it; the job's",
        "  is the launcher's wall-clock: rank 0's split, the launcher's own start-up and restarts."], args.out)


if __name__ == "__main__":
    main()
