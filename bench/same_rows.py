"""Do this checkout's runs write the same metrics rows as another checkout's? `sim` for each of
four configurations, here and there, one after the other; every row's keys compared, and every
value that does not depend on the clock (losses, tokens, bytes, members, the modelled link time).

    python bench/same_rows.py --base /work/base [--steps 100] [-- FLAGS FOR EVERY RUN, e.g. --model tiny]

--base: a folder holding the other checkout's `mlx_diloco` package. --steps: cut each run short
(default: each configuration's own steps). Exits 1 when a row differs, naming the first difference.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CONFIGURATIONS = {
    "default sim": [],
    "streaming int4 with error feedback": ["--fragments", "2", "--overlap-steps", "1", "--compress", "int4",
                                           "--error-feedback"],
    "quorum rounds": ["--strategy", "quorum", "--quorum", "3", "--grace-steps", "2", "--worker-speeds", "1,1,0.5,1",
                      "--speed-policy", "time"],
    "membership schedule": ["--membership", "0:4,50:3,100:4"],
}
# What the clock decides: measured times and what is worked out from them.
MEASURED = {"compute_s", "modelled_time_s", "sync_wait_s", "utilisation", "measured_utilisation", "busy_s", "link_s",
            "straggler_s", "mfu", "peak_gflops", "wall_s", "time", "peak_memory_bytes", "idle_fraction",
            "tokens_per_s", "process_s", "time_s"}


def rows(package_root: Path, flags: list, folder: Path) -> list:
    env = {**os.environ, "PYTHONPATH": str(package_root)}
    done = subprocess.run([sys.executable, "-m", "mlx_diloco", "sim", *flags, "--run-dir", str(folder)],
                          capture_output=True, text=True, env=env, cwd=package_root)
    if done.returncode:
        sys.exit(f"sim {' '.join(flags)} failed in {package_root}:\n{done.stderr[-2000:]}")
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def difference(here: list, there: list) -> str:
    """The first difference between two runs' rows ('' if none)."""
    if len(here) != len(there):
        return f"{len(here)} rows here, {len(there)} there"
    for a, b in zip(here, there):
        if set(a) - MEASURED != set(b) - MEASURED:  # (a measurement one checkout has and not the other: kept apart)
            return f"step {a.get('step')}: keys {sorted((set(a) ^ set(b)) - MEASURED)} in one only"
        for key in sorted(set(a) - MEASURED):
            if a[key] != b[key]:
                return f"step {a['step']}: {key} {a[key]!r} here, {b[key]!r} there"
    return ""


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="the other checkout (a folder holding its mlx_diloco package)")
    p.add_argument("--steps", type=int, help="steps of each run (default: the configuration's)")
    p.add_argument("flags", nargs="*", help="sim flags added to every run (after --)")
    args = p.parse_args()
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, flags) in enumerate(CONFIGURATIONS.items()):
            flags = flags + args.flags + (["--steps", str(args.steps)] if args.steps else [])
            here = rows(ROOT, flags, Path(tmp) / f"here-{i}")
            there = rows(Path(args.base).resolve(), flags, Path(tmp) / f"there-{i}")
            why = difference(here, there)
            failed |= bool(why)
            print(f"{name:40s} {len(here)} rows: {'identical' if not why else 'DIFFER: ' + why}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
