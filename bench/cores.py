"""Cores in use: run a command and report how many cores its processes kept busy.

    python bench/cores.py -- mlx-diloco sim --processes 1

Samples user+system CPU time of the command and all its descendants from /proc once a second
(Linux). Prints the mean over the whole run and over its busiest 80% (start-up, tokenizing and the
final sample run on one core).
"""

import os
import subprocess
import sys
import time

TICK = os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(root: int) -> float:
    """User + system seconds of `root` and its live descendants."""
    stats = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        stats[int(pid)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK)  # ppid, utime+stime
    children, total, todo = {}, 0.0, [root]
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    while todo:
        pid = todo.pop()
        total += stats.get(pid, (0, 0.0))[1]
        todo += children.get(pid, [])
    return total


def main():
    command = sys.argv[sys.argv.index("--") + 1:] if "--" in sys.argv else sys.argv[1:]
    if not command:
        sys.exit("usage: python bench/cores.py -- COMMAND...")
    t0 = time.time()
    proc = subprocess.Popen(command)
    samples, last = [], 0.0
    while proc.poll() is None:
        time.sleep(1.0)
        cpu = tree_cpu_seconds(proc.pid)
        samples.append(cpu - last)  # CPU seconds used in the last second, of processes alive now
        last = cpu
    wall = time.time() - t0
    busy = sorted(samples)[len(samples) // 5:] if samples else [0.0]
    print(f"cores in use: {sum(busy) / len(busy):.2f} over the busiest 80% of {len(samples)} s, "
          f"{sum(max(s, 0) for s in samples) / max(wall, 1e-9):.2f} over the whole run; wall {wall:.0f} s; "
          f"{os.cpu_count()} cores", file=sys.stderr)
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
