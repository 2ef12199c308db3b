"""Checkpoints, taken every H steps (DiLoCo) and at the end of a run, written atomically.

A checkpoint is two files: `ckpt-STEP.safetensors` (every array: the global model, the outer
optimizer, each worker's parameters and inner AdamW state; with Streaming DiLoCo also each
fragment's error-feedback buffer and the pseudo-gradient of an exchange in flight, which a resumed
run sends again) and `ckpt-STEP.json` (the config,
step, data cursors, RNG state). `latest.json` names the newest complete checkpoint and is
replaced last, so a crash while writing leaves the previous checkpoint in force.
"""

import json
import os
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from ..atomic import atomic_write_text
from ..config import ConfigError

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


def steps(run_dir: Path) -> list:
    """Steps of the checkpoints on disk whose two files are both present, newest first."""
    found = [_step_of(p) for p in Path(run_dir).glob("ckpt-*.json") if p.with_suffix(".safetensors").exists()]
    return sorted(found, reverse=True)


def latest_step(run_dir: Path):
    """The step latest.json names, or (it is missing or torn) the newest checkpoint on disk."""
    try:
        return json.loads((Path(run_dir) / "latest.json").read_text())["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return next(iter(steps(run_dir)), None)


def _read(run_dir: Path, step: int):
    meta = json.loads((run_dir / f"ckpt-{step}.json").read_text())
    flat = mx.load(str(run_dir / f"ckpt-{step}.safetensors"))
    return tree_unflatten(list(flat.items())), meta


def load(run_dir: Path, step: int = None, log=print):
    """(arrays tree, meta) of the given checkpoint, or else of the newest intact one: a checkpoint
    that cannot be read (a torn file after a crash, a full disk) is skipped, and `log` says so."""
    run_dir = Path(run_dir)
    if step is not None:
        candidates = [step]
    else:
        newest = latest_step(run_dir)
        candidates = ([newest] if newest is not None else []) + [s for s in steps(run_dir) if s != newest]
    if not candidates:
        raise ConfigError(f"no checkpoint in {run_dir}; pass the folder of a run that saved one")
    errors = []
    for s in candidates:
        try:
            out = _read(run_dir, s)
        except Exception as e:  # torn file, bad JSON, bad header...
            errors.append(f"checkpoint {s} is unreadable ({type(e).__name__}: {e})")
            continue
        for e in errors:
            log(f"{e}; using checkpoint {s}")
        return out
    raise ConfigError(f"no intact checkpoint in {run_dir}: {'; '.join(errors)}; start a new run")
