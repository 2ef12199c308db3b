"""`mlx-diloco sim` here against the same command in another checkout, side by side: start-up,
steps/s and the final eval loss, runs alternating so that both see the same machine.

    python bench/sim_speed.py --base .base [--also NAME=FOLDER ...] [--rounds 3] [-- SIM FLAGS...]

--base: a folder holding the other checkout's `mlx_diloco` package (e.g. `git worktree add
/tmp/base 78320fe`, or `.base` with a copy of its package); --also: more checkouts, each run in
turn with base and this one in every round (e.g. the commit between them, to say which one's
changes cost); the sim flags default to none (the default `sim`). Start-up: from the command's
start to the end of its first training step (the first metrics row after step 0 gives its wall
time); steps/s: over the rest of the run; compute: the run's own summary of its time in steps.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one_run(package_root: Path, flags: list, folder: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(package_root)}
    started = time.time()
    done = subprocess.run([sys.executable, "-m", "mlx_diloco", "sim", *flags, "--run-dir", str(folder)],
                          capture_output=True, text=True, env=env, cwd=package_root)
    wall = time.time() - started
    if done.returncode:
        sys.exit(f"sim failed in {package_root}:\n{done.stderr[-2000:]}")
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((folder / "summary.json").read_text())
    first = next(r for r in rows if r["step"] > 0)
    steps = summary["steps"] - first["step"]
    return {"wall_s": wall, "startup_s": wall - (rows[-1]["wall_s"] - first["wall_s"]),
            "steps_per_s": steps / (rows[-1]["wall_s"] - first["wall_s"]), "final_eval_loss": summary["final_eval_loss"],
            "compute_s": summary.get("compute_s", float("nan"))}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="folder with the other checkout's mlx_diloco package")
    p.add_argument("--also", action="append", default=[], metavar="NAME=FOLDER",
                   help="another checkout run in turn with the two (repeatable)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("flags", nargs="*", help="sim's flags (after --)")
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from cluster_links import doctor_gflops
    print(f"# python bench/sim_speed.py {' '.join(sys.argv[1:])}   (doctor: {doctor_gflops()})", flush=True)
    checkouts = {"base": Path(args.base).resolve(),
                 **{a.split("=", 1)[0]: Path(a.split("=", 1)[1]).resolve() for a in args.also}, "here": ROOT}
    results = {name: [] for name in checkouts}
    with tempfile.TemporaryDirectory(prefix="sim-speed-") as tmp:
        for r in range(args.rounds):
            for name, root in checkouts.items():
                results[name].append(one_run(root, args.flags, Path(tmp) / f"{name}-{r}"))
                print(f"round {r + 1} {name}: " + ", ".join(f"{k} {v:.4f}" for k, v in results[name][-1].items()),
                      flush=True)
    print(f"\n{'checkout':8} {'wall s':>8} {'start-up s':>11} {'compute s':>10} {'steps/s':>9} {'final eval loss':>16}"
          f"  (median of {args.rounds})")
    for name, runs in results.items():
        med = {k: statistics.median(run[k] for run in runs) for k in runs[0]}
        print(f"{name:8} {med['wall_s']:8.1f} {med['startup_s']:11.2f} {med['compute_s']:10.1f} {med['steps_per_s']:9.2f} "
              f"{med['final_eval_loss']:16.4f}")
    for name in results:
        if name != "base":
            speed = [h["steps_per_s"] / b["steps_per_s"] for h, b in zip(results[name], results["base"])]
            print(f"steps/s {name} / base, round by round: {', '.join(f'{s:.3f}' for s in speed)}")


if __name__ == "__main__":
    main()
