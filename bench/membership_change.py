"""Today's cost of a membership change (issue 24's baseline): on a real (emulated) 3-host cluster a
machine drops out mid-round, the launcher (`--on-loss shrink`) stops the survivors and restarts them
from the newest outer-step checkpoint. For each model preset, the phases of that change:

    detect    the machine is killed -> the launcher's `failure` event
    stop      failure -> the survivors stopped (`shrunk` event)
    start     shrunk -> new worker processes started through the agents (`started` event)
    ring      started -> the survivors' ring connections are up (TCP, seen with `ss` in each host)
    load      ring -> every survivor has loaded the model, data and checkpoint ("resumed ... at step")
    step      load -> every survivor has reported its first inner step after the restart
    redo      inner steps the survivors had taken past the checkpoint they restart from (lost work)

Times come from the launcher's events.jsonl and from a poller here that watches, every 50 ms, each
survivor's worker log, progress file and TCP connections (so ring/load/step are +-50 ms). No state
is transferred to a joiner today: a restart reads each survivor's own checkpoint from its own disk.
Needs root (network namespaces; see cluster/netns-cluster.sh).

    sudo .venv/bin/python bench/membership_change.py      # ~5 minutes on a 2-core machine
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import statistics
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from mlx_diloco.blas import ensure_fast_blas  # noqa: E402

HOSTS, LOST = 3, 3  # host3's machine drops out
PHASES = ["detect", "stop", "start", "ring", "load", "step"]
TIMES = [*PHASES, "stop->step", "total"]  # the table's columns of seconds


class Watcher(threading.Thread):
    """Polls the survivors every 50 ms and keeps, per host, the times things were first seen:
    ring connections up, the 'resumed' log line, each progress step."""

    def __init__(self, cluster, hosts: list, agent_port: int):
        super().__init__(daemon=True)
        self.cluster, self.hosts, self.agent_port = cluster, hosts, agent_port
        self.ring_up = {h: [] for h in hosts}     # times the host had ring connections established
        self.resumed = {}                          # host -> time the 'resumed' line was first seen
        self.steps = {h: [] for h in hosts}       # host -> [(time, step)], each new step as first seen
        self.done = threading.Event()

    def run(self):
        while not self.done.is_set():
            now = time.time()
            for h in self.hosts:
                if self._ring_connected(h):
                    self.ring_up[h].append(now)
                if h not in self.resumed and "resumed " in self._log(h):
                    self.resumed[h] = now
                p = self.cluster.progress(h)
                if p is not None and (not self.steps[h] or self.steps[h][-1][1] != p["step"]):
                    self.steps[h].append((now, p["step"]))
            time.sleep(0.05)

    def _ring_connected(self, h: int) -> bool:
        """An established TCP connection in the host's namespace that is not an agent's: the ring."""
        out = subprocess.run(["ip", "netns", "exec", f"mdt{h}", "ss", "-tnH", "state", "established"],
                             capture_output=True, text=True).stdout
        return any(f":{self.agent_port}" not in line for line in out.splitlines() if line.strip())

    def _log(self, h: int) -> str:
        try:
            return (self.cluster.job_folder(h) / "worker.log").read_text(errors="replace")
        except (OSError, StopIteration):
            return ""


def measure(cluster, folder: Path, preset: str, flags: list, kill_step: int) -> dict:
    from mlx_diloco.cluster.emulated import SECRET
    from mlx_diloco.cluster.protocol import DEFAULT_PORT
    run_dir = folder / preset
    survivors = [h for h in range(1, HOSTS + 1) if h != LOST]
    proc = subprocess.Popen([sys.executable, "-m", "mlx_diloco", "launch", f"--hosts={cluster.hosts_flag}",
                             "--run-dir", str(run_dir), "--on-loss=shrink", "--heartbeat-timeout=3",
                             f"--model={preset}", *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "MLX_DILOCO_SECRET": SECRET})
    watcher = Watcher(cluster, survivors, DEFAULT_PORT)
    watcher.start()
    deadline = time.time() + 300
    while not ((p := cluster.progress(LOST)) and p["step"] >= kill_step):
        if proc.poll() is not None or time.time() > deadline:
            raise SystemExit(f"{preset}: host{LOST} never reached step {kill_step}:\n{proc.communicate()[0][-3000:]}")
        time.sleep(0.02)
    cluster.kill_host(LOST)
    killed_at = time.time()
    out = proc.communicate(timeout=600)[0]
    watcher.done.set()
    watcher.join()
    if proc.returncode != 0:
        raise SystemExit(f"{preset}: the launch failed:\n{out[-3000:]}")
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    first = lambda kind: next(e for e in events if e["event"] == kind and e["time"] >= killed_at)
    failure, shrunk, started = first("failure"), first("shrunk"), first("started")
    resume = started["resume_step"] or 0
    ring = max(min(t for t in watcher.ring_up[h] if t >= shrunk["time"]) for h in survivors)
    load = max(watcher.resumed[h] for h in survivors)
    step = max(min(t for t, s in watcher.steps[h] if s > resume and t >= load) for h in survivors)
    reached = [max(s for t, s in watcher.steps[h] if t <= shrunk["time"]) for h in survivors]
    # Old checkpoints are pruned by now; they are all of one size.
    checkpoint = next(cluster.job_folder(survivors[0]).glob("worker-*/ckpt-*.safetensors"))
    times = [killed_at, failure["time"], shrunk["time"], started["time"], ring, load, step]
    return {**{name: b - a for name, a, b in zip(PHASES, times, times[1:])}, "total": step - killed_at,
            "stop->step": step - failure["time"],
            "killed_at_step": p["step"], "resume_step": resume, "redo": max(reached) - resume,
            "checkpoint_bytes": checkpoint.stat().st_size, "why": failure["why"]}


def median_run(runs: list) -> dict:
    """Each phase's median over the repeats (and the run's other facts from the first)."""
    return {**runs[0], **{n: statistics.median(r[n] for r in runs) for n in [*TIMES, "redo"]}}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", default="small,gpt-10m", help="model presets, comma-separated")
    p.add_argument("--sync-every", type=int, default=20, help="DiLoCo H")
    p.add_argument("--repeats", type=int, default=3, help="changes measured per preset (the table shows medians)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "membership_change.txt"))
    args = p.parse_args()
    ensure_fast_blas([__file__, *sys.argv[1:]])
    from cluster_links import save_table
    from mlx_diloco.cluster.emulated import EmulatedCluster, can_build
    if why := can_build():
        raise SystemExit(f"cannot build the emulated cluster: {why}")

    H = args.sync_every
    steps, kill_step = 3 * H, H + H // 2  # killed mid-round 2: the newest checkpoint is at step H
    flags = ["--workers=3", "--strategy=diloco", f"--sync-every={H}", f"--steps={steps}", "--seq-len=64",
             "--batch-size=4", "--eval-batches=1", f"--eval-every={steps}", "--warmup=5", "--compress=fp16"]
    doctor = subprocess.run([str(ROOT / ".venv" / "bin" / "mlx-diloco"), "doctor"], capture_output=True, text=True)
    gflops = next((l.strip() for l in doctor.stdout.splitlines() if "GFLOP" in l), "(doctor printed no GFLOP/s line)")
    lines = [f"command: sudo .venv/bin/python bench/{Path(__file__).name} {' '.join(sys.argv[1:])}".rstrip(),
             f"doctor: {gflops}",
             f"{HOSTS} hosts, DiLoCo H={H}, {steps} steps, 4x64 tokens a step, fp16 exchange; host{LOST}'s machine "
             f"killed at step {kill_step} (mid-round), --on-loss shrink --heartbeat-timeout 3",
             f"{'preset':8} " + " ".join(f"{n:>8}" for n in TIMES) + f" {'redo/worker':>11} "
             f"{'ckpt read':>11}"]
    print(lines[0], flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets.split(","):
            runs = []
            for i in range(args.repeats):
                cluster = EmulatedCluster(HOSTS, Path(tmp) / f"cluster-{preset}-{i}")
                try:
                    runs.append(measure(cluster, Path(tmp) / str(i), preset, flags, kill_step))
                finally:
                    cluster.close()
                r = runs[-1]
                print(f"  {preset} #{i + 1}: " + " ".join(f"{n} {r[n]:.2f}s" for n in TIMES) +
                      f"; killed at step {r['killed_at_step']}, restarted from {r['resume_step']} "
                      f"(redo {r['redo']}); {r['why']}", flush=True)
            r = median_run(runs)
            lines.append(f"{preset:8} " + " ".join(f"{r[n]:>{len(n)}.2f}s".rjust(8) for n in TIMES) +
                         f" {r['redo']:>5.0f} steps {r['checkpoint_bytes'] / 1e6:>8.1f} MB")
    save_table(lines + [
        "detect: kill -> failure event; stop: -> survivors stopped (shrunk); start: -> new processes started",
        "  (started); ring: -> survivors' ring TCP connections up; load: -> model, data and checkpoint loaded",
        "  ('resumed' in every survivor's log); step: -> every survivor's first inner step after the restart;",
        "  stop->step: failure noticed -> first step (today's restart); total: kill -> first step.",
        "  ring/load/step polled every 50 ms. Medians of the repeats (so the columns need not add up).",
        "  redo: inner steps each survivor had taken past the checkpoint it restarts from (lost). ckpt read: the checkpoint",
        "  file each survivor loads from its own disk to restart. State sent to a joiner today: 0 bytes (no",
        "  machine can join a running job; a restart ships nothing, the agents keep the shards)."],
        args.out)


if __name__ == "__main__":
    main()
