"""Checkpoints, taken every H steps (DiLoCo) and at the end of a run, written atomically.

A checkpoint is two files (run_folder.py names them, and reads what is MLX-free):
- `ckpt-STEP.safetensors`, every array, flattened from the tree
  {"workers": {"params", "inner"}, "strategy": strategy.state()}: each local worker's parameters and
  inner optimizer state, and what the strategy saves of its own (DiLoCo: each fragment's global
  values and outer optimizer; Streaming DiLoCo also its error-feedback buffer and the
  pseudo-gradient of an exchange in flight, which a resumed run sends again);
- `ckpt-STEP.json`, its meta: the keys of run_folder.META (layout, step, config, data cursors,
  compute time, worker speeds, the exchange ledger, the model's preset, the vocabulary size).
  No random state is saved: the data order follows from the seed and the cursors, SPARTA's indices
  and the codecs' rounding from seeds, the step and the values. Only bf16's stochastic rounding of
  updates draws from MLX's random state, which a resumed run starts again from the seed.
`latest.json` names the newest complete checkpoint and is replaced last, so a crash while writing
leaves the previous checkpoint in force. A checkpoint of another layout is one ConfigError line.
A run writes through one `Writer`: one checkpoint at a time, in order, a run's periodic ones on a
thread of their own while training goes on where the memory holds the state beside the next one.
"""

import json
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from ..atomic import atomic_write_text
from ..config import ConfigError
from ..run_folder import LAYOUT, _step_of, candidates, meta_flaw, read_meta

KEEP = 2  # checkpoints kept on disk


SAFETENSORS_DTYPES = {mx.float32: "F32", mx.float16: "F16", mx.bfloat16: "BF16", mx.float64: "F64",
                      mx.int8: "I8", mx.int16: "I16", mx.int32: "I32", mx.int64: "I64", mx.uint8: "U8",
                      mx.uint16: "U16", mx.uint32: "U32", mx.uint64: "U64", mx.bool_: "BOOL"}


@dataclass
class Staged:
    """An array ready to be written by any thread: its safetensors dtype and its values as a numpy
    view (no copy) of the evaluated MLX array, which it keeps alive (`stage`)."""
    dtype: str
    values: np.ndarray

    @classmethod
    def of(cls, a: mx.array) -> "Staged":
        bits = a.view(mx.uint16) if a.dtype == mx.bfloat16 else a  # (numpy has no bf16: its bits)
        mx.eval(bits)
        return cls(SAFETENSORS_DTYPES[a.dtype], np.asarray(bits))


def stage(arrays: dict) -> dict:
    """The tree with every array Staged: evaluated here, on the thread that runs MLX, so that another
    thread may write it (`save` touches no MLX for a staged tree)."""
    return tree_map(Staged.of, arrays)


def write_safetensors(path: Path, flat: dict, metadata: dict):
    """mx.save_safetensors, one array at a time: `flat` (path -> array, or Staged) is emptied as it is
    written, so arrays that are lazy reads of other files (an offloaded outer state) are in memory
    one at a time. mx.save_safetensors holds them all: 6.6 GB above the training peak at 1B."""
    header, offset = {"__metadata__": metadata}, 0
    for key, a in flat.items():
        dtype, nbytes = (a.dtype, a.values.nbytes) if isinstance(a, Staged) else (SAFETENSORS_DTYPES[a.dtype], a.nbytes)
        header[key] = {"dtype": dtype, "shape": list(a.values.shape if isinstance(a, Staged) else a.shape),
                       "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the format aligns the data to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for key in list(flat):
            a = flat.pop(key)
            f.write(np.ascontiguousarray(a.values if isinstance(a, Staged) else Staged.of(a).values).data)


def save(folder: Path, step: int, arrays: dict, meta: dict, durable: bool = True):
    """Checkpoint `step` in `folder`: `arrays`, the nested tree of mx.arrays (see above; or `stage`d:
    then any thread may save it), is emptied as it is written (pass it inline: see write_safetensors); `meta` holds records.META's keys
    but layout and step, which are added here. `durable=False` leaves the files to the page cache
    (no fsync): for a state this machine's next process reads (an elastic worker's own), which a
    process's death does not lose; after a machine's crash a torn one is passed over (`load`)."""
    meta = {**meta, "layout": LAYOUT, "step": step}
    if why := meta_flaw(meta):
        raise ValueError(f"checkpoint meta does not match the schema: {why}")
    flat = dict(tree_flatten(arrays))
    arrays.clear()  # the flat dict holds the only references: each array is dropped once written
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".ckpt-{step}.tmp.safetensors"
    write_safetensors(tmp, flat, {"format": "mlx-diloco", "step": str(step), "layout": str(LAYOUT)})
    if durable:
        with open(tmp, "rb") as f:  # fsync through a fresh handle, then rename into place
            os.fsync(f.fileno())
    tmp.replace(folder / f"ckpt-{step}.safetensors")
    atomic_write_text(folder / f"ckpt-{step}.json", json.dumps(meta, indent=1), durable)
    atomic_write_text(folder / "latest.json", json.dumps({"step": step}), durable)
    for old in sorted(folder.glob("ckpt-*.json"), key=_step_of)[:-KEEP]:
        old.unlink(missing_ok=True)
        old.with_suffix(".safetensors").unlink(missing_ok=True)


def fits_beside(arrays: dict, memory_limit: float = 0) -> bool:
    """Whether the run's peak memory and `arrays` held beside it (a state kept while the run makes
    the next one) fit the memory limit: the run's (bytes), or else MLX's own, on a Mac no more than
    the GPU's recommended working set (MLX's default limit lies above it, where macOS swaps)."""
    held = sum(v.nbytes for _, v in tree_flatten(arrays))
    limit = memory_limit or mx.get_memory_limit()
    if not memory_limit and mx.metal.is_available():
        limit = min(limit, mx.metal.device_info().get("max_recommended_working_set_size", limit))
    return mx.get_peak_memory() + held <= limit


class Writer:
    """Writes one folder's checkpoints one at a time, in the order asked. `save(..., background=True)`
    stages the state (evaluated here, on MLX's thread; views, no copy) and writes it on a thread of
    its own while training goes on: a step is not stopped for the disk (on the emulated cluster,
    296 MB a host, ~0.4 s a checkpoint). The staged arrays stay in memory until written (the run
    makes new ones meanwhile), so a caller asks for it only where they fit (`fits_beside`). The
    thread is not a daemon: a run that stops, even with an error, exits once its checkpoint is on
    the disk. A write that failed raises at the next `save` or `wait`."""

    def __init__(self):
        self._writing = threading.Lock()  # held while a checkpoint is written (released by its writer)
        self._failed = None

    def save(self, folder: Path, step: int, arrays: dict, meta: dict, durable: bool = True, background: bool = False):
        """checkpoint.save, after the write in flight; `arrays` is emptied."""
        self._writing.acquire()
        started = False
        try:
            self._raise_failure()
            if background:
                staged = stage(arrays)
                arrays.clear()
                threading.Thread(target=self._write, args=(folder, step, staged, meta, durable),
                                 name=f"checkpoint {step}").start()
                started = True
            else:
                save(folder, step, arrays, meta, durable)
        finally:
            if not started:
                self._writing.release()

    def _write(self, *args):
        try:
            save(*args)
        except BaseException as e:  # (raised on the run's thread: `_raise_failure`)
            self._failed = e
        finally:
            self._writing.release()

    def wait(self):
        """Until the checkpoint in flight is on the disk."""
        with self._writing:
            self._raise_failure()

    def _raise_failure(self):
        if self._failed is not None:
            failed, self._failed = self._failed, None
            raise failed


def in_order_of(tree, saved):
    """`saved`, its dicts' keys in the order `tree` has them (a checkpoint reads back sorted, and
    whatever walks a tree in order, SPARTA's flat indices, must find the same parameters)."""
    if isinstance(saved, dict) and isinstance(tree, dict):
        keys = [k for k in tree if k in saved] + [k for k in saved if k not in tree]
        return {k: in_order_of(tree.get(k), saved[k]) for k in keys}
    if isinstance(saved, (list, tuple)) and isinstance(tree, (list, tuple)) and len(saved) == len(tree):
        return type(saved)(in_order_of(t, v) for t, v in zip(tree, saved))
    return saved


def _read(folder: Path, step: int):
    meta = read_meta(folder, step)
    flat = mx.load(str(folder / f"ckpt-{step}.safetensors"))
    return tree_unflatten(list(flat.items())), meta


def load(folder: Path, step: int = None, log=print):
    """(arrays tree, meta) of the given checkpoint, or else of the newest intact one: a checkpoint
    that cannot be read (a torn file after a crash, a full disk) is skipped, and `log` says so.
    A checkpoint of another layout is one ConfigError line (run_folder.check_layout)."""
    folder = Path(folder)
    tried = [step] if step is not None else candidates(folder)
    if not tried:
        raise ConfigError(f"no checkpoint in {folder}; pass the folder of a run that saved one")
    errors = []
    for s in tried:
        try:
            out = _read(folder, s)
        except ConfigError:  # another layout: every checkpoint of the run has it
            raise
        except Exception as e:  # torn file, bad JSON, bad header...
            errors.append(f"checkpoint {s} is unreadable ({type(e).__name__}: {e})")
            continue
        for e in errors:
            log(f"{e}; using checkpoint {s}")
        return out
    raise ConfigError(f"no intact checkpoint in {folder}: {'; '.join(errors)}; start a new run")
