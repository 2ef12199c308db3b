"""Checkpoints, taken every H steps (DiLoCo) and at the end of a run, written atomically.

A checkpoint is two files: `ckpt-STEP.safetensors` (every array: each worker's parameters and
inner AdamW state; DiLoCo's global values and outer optimizer, per fragment; with Streaming DiLoCo
also each fragment's error-feedback buffer and the pseudo-gradient of an exchange in flight, which
a resumed run sends again) and `ckpt-STEP.json` (the config, step, data cursors, RNG state).
`latest.json` names the newest complete checkpoint and is replaced last, so a crash while writing
leaves the previous checkpoint in force.
"""

import json
import os
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_unflatten

from ..atomic import atomic_write_text
from ..config import ConfigError
from ..run_folder import _step_of, candidates

KEEP = 2  # checkpoints kept on disk


SAFETENSORS_DTYPES = {mx.float32: "F32", mx.float16: "F16", mx.bfloat16: "BF16", mx.float64: "F64",
                      mx.int8: "I8", mx.int16: "I16", mx.int32: "I32", mx.int64: "I64", mx.uint8: "U8",
                      mx.uint16: "U16", mx.uint32: "U32", mx.uint64: "U64", mx.bool_: "BOOL"}


def write_safetensors(path: Path, flat: dict, metadata: dict):
    """mx.save_safetensors, one array at a time: `flat` (path -> array) is emptied as it is
    written, so arrays that are lazy reads of other files (an offloaded outer state) are in memory
    one at a time. mx.save_safetensors holds them all: 6.6 GB above the training peak at 1B."""
    header, offset = {"__metadata__": metadata}, 0
    for key, a in flat.items():
        header[key] = {"dtype": SAFETENSORS_DTYPES[a.dtype], "shape": list(a.shape),
                       "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the format aligns the data to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for key in list(flat):
            a = flat.pop(key)
            f.write(np.ascontiguousarray(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a).data)


def save(run_dir: Path, step: int, flat: dict, meta: dict):
    """`flat`: path -> mx.array, emptied as it is written (see write_safetensors); `meta`: JSON-able state."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f".ckpt-{step}.tmp.safetensors"
    write_safetensors(tmp, flat, {"format": "mlx-diloco", "step": str(step)})
    with open(tmp, "rb") as f:  # fsync through a fresh handle, then rename into place
        os.fsync(f.fileno())
    tmp.replace(run_dir / f"ckpt-{step}.safetensors")
    atomic_write_text(run_dir / f"ckpt-{step}.json", json.dumps({**meta, "step": step}, indent=1))
    atomic_write_text(run_dir / "latest.json", json.dumps({"step": step}))
    for old in sorted(run_dir.glob("ckpt-*.json"), key=_step_of)[:-KEEP]:
        old.unlink(missing_ok=True)
        old.with_suffix(".safetensors").unlink(missing_ok=True)


def _read(run_dir: Path, step: int):
    meta = json.loads((run_dir / f"ckpt-{step}.json").read_text())
    flat = mx.load(str(run_dir / f"ckpt-{step}.safetensors"))
    return tree_unflatten(list(flat.items())), meta


def load(run_dir: Path, step: int = None, log=print):
    """(arrays tree, meta) of the given checkpoint, or else of the newest intact one: a checkpoint
    that cannot be read (a torn file after a crash, a full disk) is skipped, and `log` says so."""
    run_dir = Path(run_dir)
    tried = [step] if step is not None else candidates(run_dir)
    if not tried:
        raise ConfigError(f"no checkpoint in {run_dir}; pass the folder of a run that saved one")
    errors = []
    for s in tried:
        try:
            out = _read(run_dir, s)
        except Exception as e:  # torn file, bad JSON, bad header...
            errors.append(f"checkpoint {s} is unreadable ({type(e).__name__}: {e})")
            continue
        for e in errors:
            log(f"{e}; using checkpoint {s}")
        return out
    raise ConfigError(f"no intact checkpoint in {run_dir}: {'; '.join(errors)}; start a new run")
