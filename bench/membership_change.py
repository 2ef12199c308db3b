"""What a membership change costs (issue 24): on a real (emulated) 3-host cluster a machine drops
out mid-round and the launcher (`--on-loss shrink`) goes on with the survivors. Measured side by side
for this checkout and for --baseline (a git revision, run from a worktree: before issue 24 the
survivors restarted from the newest outer-step checkpoint, redoing their round; now each resumes from
the state it saved when asked). For each model preset, the phases of that change:

    detect    the machine is killed -> the launcher's `failure` event
    stop      failure -> the survivors stopped (`left` event; `shrunk` before)
    start     shrunk -> new worker processes started through the agents (`started` event)
    ring      started -> the survivors' ring connections are up (TCP, seen with `ss` in each host)
    load      ring -> every survivor has loaded the model, data and checkpoint ("resumed ... at step")
    step      load -> every survivor has reported its first inner step after the restart
    redo      inner steps the survivors had taken past the checkpoint they restart from (lost work)

Times come from the launcher's events.jsonl and from a poller here that watches, every 50 ms, each
survivor's worker log, progress file and TCP connections (so ring/load/step are +-50 ms). A change
ships nothing: each survivor reads its own state from its own disk (a joiner's transfer over the
ring is measured by bench/elastic.py). Needs root (network namespaces; see cluster/netns-cluster.sh).

    sudo .venv/bin/python bench/membership_change.py --baseline 0d8c4d5   # 2 presets x 2 checkouts x 3 changes
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
        out = subprocess.run(["ip", "netns", "exec", self.cluster.namespace(h), "ss", "-tnH", "state", "established"],
                             capture_output=True, text=True).stdout
        return any(f":{self.agent_port}" not in line for line in out.splitlines() if line.strip())

    def _log(self, h: int) -> str:
        try:
            return (self.cluster.job_folder(h) / "worker.log").read_text(errors="replace")
        except (OSError, StopIteration):
            return ""


def measure(cluster, folder: Path, preset: str, flags: list, kill_step: int, code: dict) -> dict:
    from mlx_diloco.cluster.emulated import SECRET
    from mlx_diloco.cluster.protocol import DEFAULT_PORT
    run_dir = folder / preset
    survivors = [h for h in range(1, HOSTS + 1) if h != LOST]
    proc = subprocess.Popen([sys.executable, "-m", "mlx_diloco", "launch", f"--hosts={cluster.hosts_flag}",
                             "--run-dir", str(run_dir), "--on-loss=shrink", "--heartbeat-timeout=3",
                             f"--model={preset}", *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, **code, "MLX_DILOCO_SECRET": SECRET})
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
    failure, started = first("failure"), first("started")
    shrunk = next(e for e in events if e["event"] in ("shrunk", "left") and e["time"] >= killed_at)
    # One step for all (a checkpoint they all hold), or each survivor's own (worker h - 1 on host h).
    resume = {h: started["resume_step"][str(h - 1)] if isinstance(started["resume_step"], dict)
              else started["resume_step"] or 0 for h in survivors}
    ring = max(min(t for t in watcher.ring_up[h] if t >= shrunk["time"]) for h in survivors)
    load = max(watcher.resumed[h] for h in survivors)
    step = max(min(t for t, s in watcher.steps[h] if s > resume[h] and t >= load) for h in survivors)
    redo = max(max(s for t, s in watcher.steps[h] if t <= shrunk["time"]) - resume[h] for h in survivors)
    # Old checkpoints are pruned by now; they are all of one size.
    checkpoint = next(cluster.job_folder(survivors[0]).glob("worker-*/ckpt-*.safetensors"))
    times = [killed_at, failure["time"], shrunk["time"], started["time"], ring, load, step]
    return {**{name: b - a for name, a, b in zip(PHASES, times, times[1:])}, "total": step - killed_at,
            "stop->step": step - failure["time"],
            "killed_at_step": p["step"], "resume_step": resume, "redo": redo,
            "checkpoint_bytes": checkpoint.stat().st_size, "why": failure["why"]}


def measure_preset(preset: str, name: str, code: dict, tmp: Path, flags: list, kill_step: int, repeats: int) -> str:
    """The table's line for one preset and one checkout (`code`: its environment), medians of the repeats."""
    from mlx_diloco.cluster.emulated import EmulatedCluster
    runs = []
    for i in range(repeats):
        cluster = EmulatedCluster(HOSTS, tmp / f"cluster-{name}-{preset}-{i}",
                                  host_env={h: code for h in range(1, HOSTS + 1)})
        try:
            runs.append(measure(cluster, tmp / f"{name}-{i}", preset, flags, kill_step, code))
        finally:
            cluster.close()
        r = runs[-1]
        print(f"  {preset} {name} #{i + 1}: " + " ".join(f"{n} {r[n]:.2f}s" for n in TIMES) +
              f"; killed at step {r['killed_at_step']}, resumed from {r['resume_step']} "
              f"(redo {r['redo']}); {r['why']}", flush=True)
    r = median_run(runs)
    return (f"{preset:8} {name:8} " + " ".join(f"{r[n]:>{len(n)}.2f}s".rjust(8) for n in TIMES) +
            f" {r['redo']:>5.0f} steps {r['checkpoint_bytes'] / 1e6:>8.1f} MB")


def median_run(runs: list) -> dict:
    """Each phase's median over the repeats (and the run's other facts from the first)."""
    return {**runs[0], **{n: statistics.median(r[n] for r in runs) for n in [*TIMES, "redo"]}}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", default="small,gpt-10m", help="model presets, comma-separated")
    p.add_argument("--sync-every", type=int, default=20, help="DiLoCo H")
    p.add_argument("--repeats", type=int, default=3, help="changes measured per preset (the table shows medians)")
    p.add_argument("--baseline", default="", help="a git revision to measure beside this checkout")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "membership_change.txt"))
    args = p.parse_args()
    ensure_fast_blas([__file__, *sys.argv[1:]])
    from cluster_links import doctor_gflops, save_table
    from mlx_diloco.cluster.emulated import can_build
    if why := can_build():
        raise SystemExit(f"cannot build the emulated cluster: {why}")

    H = args.sync_every
    steps, kill_step = 3 * H, H + H // 2  # killed mid-round 2: the newest checkpoint is at step H
    flags = ["--workers=3", "--strategy=diloco", f"--sync-every={H}", f"--steps={steps}", "--seq-len=64",
             "--batch-size=4", "--eval-sequences=4", f"--eval-every={steps}", "--warmup=5", "--compress=fp16"]
    gflops = doctor_gflops()
    lines = [f"command: sudo .venv/bin/python bench/{Path(__file__).name} {' '.join(sys.argv[1:])}".rstrip(),
             f"doctor: {gflops}",
             f"{HOSTS} hosts, DiLoCo H={H}, {steps} steps, 4x64 tokens a step, fp16 exchange; host{LOST}'s machine "
             f"killed at step {kill_step} (mid-round), --on-loss shrink --heartbeat-timeout 3",
             f"{'preset':8} {'code':8} " + " ".join(f"{n:>8}" for n in TIMES) + f" {'redo/worker':>11} "
             f"{'ckpt read':>11}"]
    print(lines[0], flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)  # `python -m mlx_diloco` finds the package in its working folder first: here, none
        codes = [("this", {})]
        if args.baseline:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", f"{tmp}/baseline", args.baseline],
                           check=True, capture_output=True)
            codes.insert(0, (args.baseline, {"PYTHONPATH": f"{tmp}/baseline"}))
        try:
            for preset in args.presets.split(","):
                for name, code in codes:
                    lines.append(measure_preset(preset, name, code, Path(tmp), flags, kill_step, args.repeats))
        finally:
            if args.baseline:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", f"{tmp}/baseline"])
    save_table(lines + [
        "detect: kill -> failure event; stop: -> survivors stopped (left; shrunk before); start: -> new processes started",
        "  (started); ring: -> survivors' ring TCP connections up; load: -> model, data and checkpoint loaded",
        "  ('resumed' in every survivor's log); step: -> every survivor's first inner step after the restart;",
        "  stop->step: failure noticed -> first step (the change); total: kill -> first step.",
        "  ring/load/step polled every 50 ms. Medians of the repeats (so the columns need not add up).",
        "  redo: inner steps a survivor had taken past the state it resumes from (lost work; the most of any",
        "  survivor). ckpt read: the state file each survivor loads from its own disk. A change ships nothing",
        "  (the agents keep the shards); a joiner's state comes over the ring (bench/elastic.py)."],
        args.out)


if __name__ == "__main__":
    main()
