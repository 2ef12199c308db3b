"""Compute utilisation of DiLoCo and DDP on a real (emulated) 2-host cluster, per link, side by side:
measured (each worker's waits on its peers, split into the link and the slower worker) and modelled,
with the model FLOPs utilisation (MFU); and the measured all-reduce time against the simulator's
network model for the same link.

Needs root (Linux network namespaces; see cluster/netns-cluster.sh). Each host's link is shaped
with tc netem to the rate and latency given. The workers are real `mlx-diloco worker` processes
started by real agents through `mlx-diloco launch`; the numbers come from rank 0's metrics.

    sudo python bench/cluster_links.py            # ~5 minutes on a 2-core machine
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from mlx_diloco.blas import ensure_fast_blas  # noqa: E402

# name: (tc rate, tc delay, the same link for the network model). No added latency: this CI kernel
# has no netem qdisc (the script shapes the rate with tbf); the bridge adds ~0.05 ms.
LINKS = {"1gbit": ("1gbit", "", "1gbit/0.05ms"), "100mbit": ("100mbit", "", "100mbit/0.05ms")}


def run_job(cluster, folder: Path, name: str, flags: list, env: dict = None) -> dict:
    """`launch` a job of `flags` on the emulated cluster, its run folder folder/name (`env`: more of the
    launcher's environment, e.g. PYTHONPATH: another checkout's); rank 0's last metrics row."""
    from mlx_diloco.cluster.emulated import SECRET
    run_dir = folder / name
    folder.mkdir(parents=True, exist_ok=True)  # (and the launcher's directory: no checkout's package beside it)
    result = subprocess.run([sys.executable, "-m", "mlx_diloco", "launch", f"--hosts={cluster.hosts_flag}",
                             "--run-dir", str(run_dir), *flags], capture_output=True, text=True, cwd=folder,
                            env={**os.environ, "MLX_DILOCO_SECRET": SECRET, **(env or {})}, timeout=1200)
    if result.returncode != 0:
        raise SystemExit(f"{name} failed:\n{result.stderr[-3000:]}")
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])


ALL_REDUCE = """
import json, os, statistics, sys, time
import mlx.core as mx
group = mx.distributed.init(backend="ring", strict=True)
x = mx.ones((int(sys.argv[1]) // 2,), dtype=mx.float16)
mx.eval(x, mx.distributed.all_sum(x, stream=mx.cpu))      # connect, warm up
times = []
for _ in range(5):
    mx.eval(mx.distributed.all_sum(mx.zeros((1,)), stream=mx.cpu))  # line the ranks up
    t = time.perf_counter()
    mx.eval(mx.distributed.all_sum(x, stream=mx.cpu))
    times.append(time.perf_counter() - t)
if group.rank() == 0:
    print(json.dumps(statistics.median(times)))
"""


def measure_all_reduce(cluster, folder: Path, payload_bytes: int) -> float:
    """Median time of a ring all-reduce of `payload_bytes` (FP16) between the emulated hosts."""
    hostfile = folder / "allreduce-hosts.json"
    hostfile.write_text(json.dumps([[f"{cluster.address(i)}:{9300 + i}"] for i in range(1, cluster.n + 1)]))
    procs = [subprocess.Popen(["ip", "netns", "exec", cluster.namespace(i), sys.executable, "-c", ALL_REDUCE,
                               str(payload_bytes)], stdout=subprocess.PIPE, text=True,
                              env={**cluster.env, "MLX_RANK": str(i - 1), "MLX_HOSTFILE": str(hostfile)})
             for i in range(1, cluster.n + 1)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    return json.loads(outs[0])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small", help="model preset")
    p.add_argument("--sync-every", type=int, default=100, help="DiLoCo H")
    p.add_argument("--diloco-steps", type=int, default=300, help="inner steps of the DiLoCo run")
    p.add_argument("--ddp-steps", type=int, default=60, help="steps of the DDP run")
    p.add_argument("--links", default="1gbit,100mbit", help=f"links to test, of: {', '.join(LINKS)}")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "cluster_links.txt"), help="where to save the table")
    args = p.parse_args()
    ensure_fast_blas([__file__, *sys.argv[1:]])
    from mlx_diloco.cluster.emulated import EmulatedCluster, can_build
    from mlx_diloco.exchange.network import all_reduce_time, parse_link
    if why := can_build():
        raise SystemExit(f"cannot build the emulated cluster: {why}")

    base = [f"--model={args.model}", "--workers=2", "--eval-sequences=32", "--warmup=20"]
    lines = [f"2 hosts, model {args.model}; DiLoCo H={args.sync_every} for {args.diloco_steps} steps, "
             f"DDP for {args.ddp_steps} steps; FP16 exchange",
             f"doctor: {doctor_gflops()}",
             f"{'link':>9} {'strategy':>8} {'compute/step':>13} {'syncs':>6} {'link/sync':>10} {'slower/sync':>12} "
             f"{'all-reduce':>11} {'modelled':>9} {'util (measured)':>16} {'util (modelled)':>16} {'MFU':>6}"]
    print(lines[0])
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.links.split(","):
            rate, delay, link = LINKS[name]
            cluster = EmulatedCluster(2, Path(tmp) / name, rate=rate, delay=delay)
            try:
                for strategy, steps, extra in (("diloco", args.diloco_steps, [f"--sync-every={args.sync_every}",
                                                                                f"--eval-every={args.diloco_steps}"]),
                                               ("ddp", args.ddp_steps, [f"--eval-every={args.ddp_steps}"])):
                    row = run_job(cluster, Path(tmp) / name, strategy, base + [
                        f"--strategy={strategy}", f"--steps={steps}", f"--link={link}", *extra])
                    syncs = steps // args.sync_every if strategy == "diloco" else steps
                    payload = int(row["bytes_sent_per_worker"] / syncs)  # 2 workers: a ring sends the payload once
                    modelled = all_reduce_time(payload, 2, parse_link(link))
                    if strategy == "diloco":
                        measured = measure_all_reduce(cluster, Path(tmp) / name, payload)
                    line = (f"{name:>9} {strategy:>8} {row['compute_s'] / steps * 1e3:>10.1f} ms {syncs:>6} "
                            f"{row['link_s'] / syncs * 1e3:>7.1f} ms {row['straggler_s'] / syncs * 1e3:>9.1f} ms "
                            f"{measured * 1e3:>8.1f} ms {modelled * 1e3:>6.1f} ms {row['measured_utilisation']:>16.1%} "
                            f"{row['utilisation']:>16.1%} {row['mfu']:>6.1%}")
                    print(line, flush=True)
                    lines.append(line)
            finally:
                cluster.close()
    save_table(lines + [
        "link/sync, slower/sync: a worker's time blocked in each exchange while training (the mean of the two),",
        "  split by the workers' arrival times (comm.py): waiting for the link, and for the slower peer (the",
        "  emulated hosts share 2 cores; rank 0 also evaluates); all-reduce: a standalone ring all-reduce of",
        "  the same payload between the hosts (median of 5); modelled: the simulator's ring model for the link.",
        "util (measured): compute / (compute + both waits); util (modelled): with the modelled exchange;",
        "MFU: model FLOPs per token x tokens/s / each host's matmul peak (doctor's, with its share of the cores)."],
        args.out)


def doctor_gflops() -> str:
    """The GFLOP/s line of `mlx-diloco doctor`, recorded with the figures."""
    doctor = subprocess.run([sys.executable, "-m", "mlx_diloco", "doctor"], capture_output=True, text=True, cwd=ROOT)
    return next((line.strip() for line in doctor.stdout.splitlines() if "GFLOP" in line), "(no GFLOP/s line)")


def save_table(lines: list, out):
    """Write the table (title, header, rows, notes) to `out` and print all but the title."""
    Path(out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines[1:]))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
