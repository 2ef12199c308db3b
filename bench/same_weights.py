"""Does this checkout's cluster job end with the same weights as another checkout's? An emulated 3-host
`launch` with a planned leave and join (worker 2 leaves at step 12 and joins again at the next sync
point), once with each checkout's package (its agents, launcher and workers, on a cluster of their own);
every array of each worker's final checkpoint (its weights and moments, the strategy's global model
and outer state) compared, bit for bit.

    sudo .venv/bin/python bench/same_weights.py --base /work/base-e514 [--steps 30]

Needs root (network namespaces; see cluster/netns-cluster.sh). Exits 1 when an array differs.
"""

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from mlx_diloco.blas import ensure_fast_blas  # noqa: E402

FLAGS = ["--model=tiny", "--workers=3", "--sync-every=5", "--seq-len=32", "--batch-size=8", "--compress=fp32",
         "--warmup=2", "--eval-sequences=16", "--membership=0:3,12:2,19:3"]


def launch(cluster, root: str, run_dir: Path, steps: int):
    from mlx_diloco.cluster.emulated import SECRET
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([sys.executable, "-m", "mlx_diloco", "launch", *FLAGS, f"--steps={steps}",
                           f"--hosts={cluster.hosts_flag}", "--run-dir", str(run_dir)], capture_output=True, text=True,
                          cwd=run_dir.parent, timeout=1200,
                          env={**os.environ, "MLX_DILOCO_SECRET": SECRET, "PYTHONPATH": root})
    if done.returncode:
        sys.exit(f"launch failed with {root}:\n{done.stderr[-3000:]}")
    return [line for line in done.stderr.splitlines() if "[launch] left" in line or "[launch] joined" in line]


def final_arrays(cluster, steps: int) -> dict:
    """{worker: {array name: numpy array}} of each worker's checkpoint at the last step."""
    import mlx.core as mx
    import numpy as np
    out = {}
    for folder in cluster.folder.glob("host*/jobs/*/worker-*"):
        path = folder / f"ckpt-{steps}.safetensors"
        if path.exists():
            out[folder.name] = {k: np.array(v.astype(mx.float32) if v.dtype == mx.bfloat16 else v)
                                for k, v in mx.load(str(path)).items()}
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="the other checkout (a folder holding its mlx_diloco package)")
    p.add_argument("--steps", type=int, default=30, help="steps of the job")
    args = p.parse_args()
    ensure_fast_blas([__file__, *sys.argv[1:]])
    import numpy as np
    from mlx_diloco.cluster.emulated import EmulatedCluster, can_build
    if why := can_build():
        raise SystemExit(f"cannot build the emulated cluster: {why}")
    arrays, said = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for code, root in (("here", str(ROOT)), ("base", str(Path(args.base).resolve()))):
            cluster = EmulatedCluster(3, Path(tmp) / code, host_env={i: {"PYTHONPATH": root} for i in (1, 2, 3)},
                                      mdns=False)
            try:
                said[code] = launch(cluster, root, Path(tmp) / f"{code}-run" / "run", args.steps)
                arrays[code] = final_arrays(cluster, args.steps)
            finally:
                cluster.close()
    print(f"# python bench/same_weights.py --base {args.base} --steps {args.steps}\n# flags: {' '.join(FLAGS)}")
    for code in arrays:
        print(f"{code}: " + "; ".join(line.split("[launch] ")[1] for line in said[code]))
    here, base, differ = arrays["here"], arrays["base"], []
    if here.keys() != base.keys() or not here:
        sys.exit(f"workers' final checkpoints: {sorted(here)} here, {sorted(base)} there")
    for worker in sorted(here):
        a, b = here[worker], base[worker]
        if a.keys() != b.keys():
            differ.append(f"{worker}: arrays {sorted(a.keys() ^ b.keys())} in one only")
            continue
        differ += [f"{worker}: {k} differs by up to {np.abs(a[k] - b[k]).max():.3g}" for k in sorted(a)
                   if a[k].shape != b[k].shape or not np.array_equal(a[k], b[k])]
        print(f"{worker}: {len(a)} arrays, {sum(v.size for v in a.values()):,} values: "
              + ("identical" if not any(d.startswith(worker) for d in differ) else "DIFFER"))
    for line in differ[:20]:
        print(f"  {line}")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
