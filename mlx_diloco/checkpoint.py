"""Checkpoints, taken at outer-step boundaries and written atomically.

A checkpoint is two files: `ckpt-STEP.safetensors` (every array: the global model, the outer
optimizer, each worker's parameters and inner AdamW state) and `ckpt-STEP.json` (the config,
step, data cursors, RNG state). `latest.json` names the newest complete checkpoint and is
replaced last, so a crash while writing leaves the previous checkpoint in force.
"""

import json
import os
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from .atomic import atomic_write_text
from .config import ConfigError

KEEP = 2  # checkpoints kept on disk


def save(run_dir: Path, step: int, arrays: dict, meta: dict):
    """`arrays`: a tree of mx.arrays; `meta`: JSON-able state."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    flat = dict(tree_flatten(arrays))
    tmp = run_dir / f".ckpt-{step}.tmp.safetensors"
    mx.save_safetensors(str(tmp), flat, metadata={"format": "mlx-diloco", "step": str(step)})
    with open(tmp, "rb") as f:  # fsync through a fresh handle, then rename into place
        os.fsync(f.fileno())
    tmp.replace(run_dir / f"ckpt-{step}.safetensors")
    atomic_write_text(run_dir / f"ckpt-{step}.json", json.dumps({**meta, "step": step}, indent=1))
    atomic_write_text(run_dir / "latest.json", json.dumps({"step": step}))
    for old in sorted(run_dir.glob("ckpt-*.json"), key=_step_of)[:-KEEP]:
        old.unlink(missing_ok=True)
        old.with_suffix(".safetensors").unlink(missing_ok=True)


def _step_of(path: Path) -> int:
    return int(path.stem.split("-")[1])


def latest_step(run_dir: Path):
    pointer = Path(run_dir) / "latest.json"
    if not pointer.exists():
        return None
    return json.loads(pointer.read_text())["step"]


def load(run_dir: Path, step: int = None):
    """(arrays tree, meta) of the given or newest checkpoint; a clear ConfigError if unusable."""
    run_dir = Path(run_dir)
    try:
        step = latest_step(run_dir) if step is None else step
        if step is None:
            raise ConfigError(f"no checkpoint in {run_dir}; start without --resume, or pass the run's folder")
        meta = json.loads((run_dir / f"ckpt-{step}.json").read_text())
        flat = mx.load(str(run_dir / f"ckpt-{step}.safetensors"))
    except ConfigError:
        raise
    except Exception as e:  # truncated file, bad JSON, bad header...
        raise ConfigError(f"checkpoint {step} in {run_dir} is unreadable ({type(e).__name__}: {e}); "
                          "delete it to fall back to an earlier one, or start a new run") from None
    return tree_unflatten(list(flat.items())), meta
