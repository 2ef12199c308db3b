"""Issue 24's must-shows on the emulated cluster (network namespaces, real agents, the real launcher
and MLX ring): Macs that leave and join a running job.

1. Leave and join: 4 hosts, DiLoCo H=50, 600 steps. host4's machine is killed at step 120 (mid-round;
   a fifth of the run); a new machine (host5, named with --add, its agent started only then) appears
   at step 300 (half way) and joins at the next sync, into the free slot. Beside it, the same job on
   4 hosts uninterrupted. Reported: both final eval losses, the inner steps the survivors redid (the run's events), the tokens trained
   per shard, each change's time (stop to first inner step), and the bytes sent to the joiner.
2. A sleeping laptop: host3 of 3 SIGSTOPped for 60 s at step 120 of 1500, then resumed. The launcher
   evicts it, and admits it again at a sync point once it answers; the job completes.

    sudo .venv/bin/python bench/elastic.py                   # 3 min 37 s on a 2-core machine
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
PLOT = ROOT / "bench" / "results" / "elastic.png"

from mlx_diloco.blas import ensure_fast_blas  # noqa: E402


def launch(cluster, run_dir: Path, hosts: list, flags: list, *extra) -> subprocess.Popen:
    from mlx_diloco.cluster.emulated import SECRET
    from mlx_diloco.cluster.protocol import DEFAULT_PORT
    return subprocess.Popen([sys.executable, "-m", "mlx_diloco", "launch", *flags, "--run-dir", str(run_dir),
                             "--hosts=" + ",".join(f"{cluster.address(h)}:{DEFAULT_PORT}" for h in hosts), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "MLX_DILOCO_SECRET": SECRET})


def wait_for_step(cluster, hosts: list, step: int, proc):
    """Until one of `hosts` has reported `step`."""
    while not any((p := cluster.progress(h)) and p["step"] >= step for h in hosts):
        if proc.poll() is not None:
            raise SystemExit(f"the launch ended before step {step}:\n{proc.communicate()[0][-3000:]}")
        time.sleep(0.05)


def finish(proc, what: str) -> str:
    out = proc.communicate(timeout=3600)[0]
    if proc.returncode != 0:
        raise SystemExit(f"{what}: the launch failed:\n{out[-3000:]}")
    return out


def results(run_dir: Path) -> tuple:
    summary = json.loads((run_dir / "summary.json").read_text())
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return summary, events


def moves(events: list) -> list:
    return [f"{e['event']} worker {e['worker']} ({e['host']})" + (f" at step {e['step']}" if "step" in e else "")
            for e in events if e["event"] in ("left", "joined")]


def change_line(e: dict) -> str:
    return (f"{e['change']:5} change: {e['total_s']:.2f} s (stop {e['stop_s']:.2f} s, start {e['start_s']:.2f} s, "
            f"first inner step {e['first_step_s']:.2f} s); steps redone per worker {e['redone_steps']}")


def leave_and_join(tmp: Path, flags: list, kill_step: int, join_step: int) -> list:
    from mlx_diloco.cluster.emulated import EmulatedCluster
    cluster = EmulatedCluster(4, tmp / "cluster-whole")
    try:
        finish(launch(cluster, tmp / "whole", [1, 2, 3, 4], flags), "uninterrupted")
    finally:
        cluster.close()
    whole, _ = results(tmp / "whole")

    cluster = EmulatedCluster(5, tmp / "cluster-elastic")
    try:
        cluster.kill_host(5)  # the new machine is not there yet
        run_dir = tmp / "elastic"
        proc = launch(cluster, run_dir, [1, 2, 3, 4], flags, f"--add={cluster.address(5)}", "--heartbeat-timeout=3")
        wait_for_step(cluster, [4], kill_step, proc)
        cluster.kill_host(4)
        print(f"  killed host4 at step {kill_step}", flush=True)
        wait_for_step(cluster, [1], join_step, proc)
        cluster.start_agent(5)
        print(f"  host5's agent started at step {join_step}", flush=True)
        finish(proc, "elastic")
    finally:
        cluster.close()
    elastic, events = results(run_dir)
    from mlx_diloco.tools.plot import plot_runs
    plot_runs([tmp / "whole", run_dir], Path(PLOT), title=f"host4 killed at step {kill_step}, host5 added at step "
              f"{join_step} (elastic) against 4 hosts uninterrupted")
    joined = re.findall(r"joined at step (\d+), from worker (\d+)'s state \(([\d,]+) bytes over the ring\)",
                        (run_dir / "logs" / "worker-3.log").read_text())
    gap = elastic["final_eval_loss"] / whole["final_eval_loss"] - 1
    return [f"1. leave and join: 4 hosts, {' '.join(flags)}; host4 killed at step {kill_step}, host5 (--add) "
            f"started at step {join_step}",
            f"   final eval loss: uninterrupted {whole['final_eval_loss']:.4f}, elastic {elastic['final_eval_loss']:.4f} "
            f"({gap:+.2%})",
            f"   membership: {'; '.join(moves(events))}",
            *[f"   {change_line(e)}" for e in elastic["changes"] if e["event"] == "membership_change"],
            f"   inner steps lost per slot (the lost worker's round): {elastic['inner_steps_lost']}",
            f"   tokens trained per shard: {elastic['tokens_per_shard']} (uninterrupted {whole['tokens_per_shard']})",
            *[f"   the joiner took the job's state at step {s} from worker {w}: {b} bytes over the ring"
              for s, w, b in joined],
            f"   loss curves: {Path(PLOT).relative_to(ROOT)}"]


def sleeping_laptop(tmp: Path, flags: list, stop_step: int, sleep_s: float) -> list:
    from mlx_diloco.cluster.emulated import EmulatedCluster
    cluster = EmulatedCluster(3, tmp / "cluster-sleep")
    try:
        run_dir = tmp / "sleep"
        flags = [f if not f.startswith("--workers") else "--workers=3" for f in flags]
        proc = launch(cluster, run_dir, [1, 2, 3], flags, "--heartbeat-timeout=3", "--collective-timeout=10")
        wait_for_step(cluster, [3], stop_step, proc)
        pids = [int(p) for p in subprocess.run(["ip", "netns", "pids", cluster.namespace(3)], capture_output=True,
                                               text=True).stdout.split()]
        for pid in pids:
            os.kill(pid, 19)  # SIGSTOP: the whole machine sleeps, its agent too
        stopped_at = time.time()
        time.sleep(sleep_s)
        for pid in pids:
            os.kill(pid, 18)  # SIGCONT
        print(f"  host3 slept {sleep_s:.0f} s from step {stop_step}", flush=True)
        finish(proc, "sleeping laptop")
    finally:
        cluster.close()
    summary, events = results(run_dir)
    evicted = next(e for e in events if e["event"] == "left")
    return [f"2. a sleeping laptop: 3 hosts, host3 SIGSTOPped for {sleep_s:.0f} s at step {stop_step}",
            f"   evicted {evicted['time'] - stopped_at:.1f} s after it slept; membership: {'; '.join(moves(events))}",
            *[f"   {change_line(e)}" for e in summary["changes"] if e["event"] == "membership_change"],
            f"   the job completed: {summary['steps']} steps, {summary['workers']} workers at the end, final eval loss "
            f"{summary['final_eval_loss']:.4f}; tokens per shard {summary['tokens_per_shard']}"]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--sync-every", type=int, default=50, help="DiLoCo H")
    p.add_argument("--sleep", type=float, default=60.0, help="seconds the laptop sleeps")
    p.add_argument("--sleep-steps", type=int, default=1500, help="steps of the sleeping-laptop job")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "elastic.txt"))
    args = p.parse_args()
    ensure_fast_blas([__file__, *sys.argv[1:]])
    from cluster_links import doctor_gflops, save_table
    from mlx_diloco.cluster.emulated import can_build
    if why := can_build():
        raise SystemExit(f"cannot build the emulated cluster: {why}")
    flags = [f"--model={args.preset}", "--workers=4", "--strategy=diloco", f"--sync-every={args.sync_every}",
             f"--steps={args.steps}", f"--seq-len={args.seq_len}", "--batch-size=4", "--eval-sequences=16", "--warmup=20"]
    gflops = doctor_gflops()
    lines = [f"command: sudo .venv/bin/python bench/{Path(__file__).name} {' '.join(sys.argv[1:])}".rstrip(),
             f"doctor: {gflops}"]
    print(lines[0], flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        lines += leave_and_join(Path(tmp), flags, kill_step=args.steps // 5, join_step=args.steps // 2)
        # Long enough that the two others are still training when the laptop wakes.
        long = [f if not f.startswith("--steps") else f"--steps={args.sleep_steps}" for f in flags]
        lines += sleeping_laptop(Path(tmp), long, stop_step=args.steps // 5, sleep_s=args.sleep)
    save_table(lines, args.out)


if __name__ == "__main__":
    main()
