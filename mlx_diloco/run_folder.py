"""A run folder's files, as every part of mlx-diloco reads them: the checkpoints on disk (their
names, which are complete, the newest) and whether a folder already holds a run. MLX-free: the
agent reads its workers' checkpoints with it (training/checkpoint.py writes and loads them)."""

import json
import os
import struct
from pathlib import Path

from .options import ConfigError


def _step_of(path: Path) -> int:
    return int(path.stem.split("-")[1])


def steps(folder: Path) -> list:
    """Steps of the checkpoints on disk whose two files are both present, newest first."""
    found = [_step_of(p) for p in Path(folder).glob("ckpt-*.json") if p.with_suffix(".safetensors").exists()]
    return sorted(found, reverse=True)


def latest_step(folder: Path):
    """The step latest.json names, or (it is missing or torn) the newest checkpoint on disk."""
    try:
        return json.loads((Path(folder) / "latest.json").read_text())["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return next(iter(steps(folder)), None)


def candidates(folder: Path) -> list:
    """The steps a resume tries, in order: the one latest.json names, then the others, newest first."""
    newest = latest_step(folder)
    return ([newest] if newest is not None else []) + [s for s in steps(folder) if s != newest]


def flaw(folder: Path, step: int) -> str:
    """What is wrong with checkpoint `step`'s files ('' if nothing), found without reading its
    arrays: the JSON parses, and the safetensors file is as long as its header says (a torn write
    is shorter)."""
    folder = Path(folder)
    try:
        json.loads((folder / f"ckpt-{step}.json").read_text())
        with open(folder / f"ckpt-{step}.safetensors", "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
            size = os.fstat(f.fileno()).st_size
        end = 8 + n + max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except Exception as e:  # missing, torn, bad JSON, bad header...
        return f"{type(e).__name__}: {e}"
    return "" if size == end else f"its arrays file holds {size} of {end} bytes"


def check_new_run_dir(run_dir: Path):
    """A new run never overwrites an existing one."""
    run_dir = Path(run_dir)
    if (run_dir / "latest.json").exists() or (run_dir / "metrics.jsonl").exists():
        raise ConfigError(f"run folder {run_dir} already holds a run; pass --resume to continue it, "
                          "or choose another --run-dir")
