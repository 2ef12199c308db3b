"""A run folder's files, as every part of mlx-diloco reads them: the checkpoints on disk (their
names, which are complete, the newest), the schema of a checkpoint's meta and its layout version,
and whether a folder already holds a run. MLX-free: the agent reads its workers' checkpoints with
it (training/checkpoint.py writes and loads their arrays).

A checkpoint is two files: `ckpt-STEP.safetensors` (the arrays) and `ckpt-STEP.json` (its meta,
records.META). `latest.json` names the newest complete one."""

import json
import os
import struct
from pathlib import Path

from .options import ConfigError
from .records import META, OPTIONAL_META

LAYOUT = 2  # the checkpoint layout this version writes and reads; the versions before it wrote 1

# A checkpoint's meta: records.py declares its keys (META, always present; OPTIONAL_META, which older
# checkpoints lack). A change to META is a new LAYOUT.


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


def meta_flaw(meta: dict) -> str:
    """What is wrong with a meta's keys against META ('' if nothing)."""
    flaws = []
    if missing := sorted(META.keys() - meta.keys()):
        flaws.append(f"it lacks {missing}")
    if unknown := sorted(meta.keys() - META.keys() - OPTIONAL_META.keys()):
        flaws.append(f"{unknown} are not in run_folder.META")
    return "; ".join(flaws)


def check_layout(meta: dict, folder: Path, step: int):
    """One ConfigError line if checkpoint `step` (whose meta this is) has another layout than LAYOUT."""
    layout = meta.get("layout", 1)
    if layout == LAYOUT:
        return
    if isinstance(layout, int) and layout > LAYOUT:
        raise ConfigError(f"checkpoint {step} in {folder} was written by a newer mlx-diloco (checkpoint layout "
                          f"{layout}; this version reads layout {LAYOUT}); upgrade mlx-diloco to use it")
    raise ConfigError(f"checkpoint {step} in {folder} was written by an older mlx-diloco (checkpoint layout "
                      f"{layout}; this version reads layout {LAYOUT}); start a new run (another --run-dir), "
                      "or resume, sample or export this one with the version that wrote it")


def read_meta(folder: Path, step: int) -> dict:
    """Checkpoint `step`'s meta (META): one ConfigError line for another layout; an unreadable
    file or a meta of other keys raises as it is (a damaged checkpoint, which callers pass over)."""
    meta = json.loads((Path(folder) / f"ckpt-{step}.json").read_text())
    check_layout(meta, folder, step)
    if why := meta_flaw(meta):
        raise ValueError(f"its meta does not match the schema: {why}")
    return meta


def flaw(folder: Path, step: int) -> str:
    """What is wrong with checkpoint `step`'s files ('' if nothing), found without reading its
    arrays: the meta reads (one ConfigError line, raised, for another layout), and the safetensors
    file is as long as its header says (a torn write is shorter)."""
    folder = Path(folder)
    try:
        read_meta(folder, step)
        with open(folder / f"ckpt-{step}.safetensors", "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
            size = os.fstat(f.fileno()).st_size
        end = 8 + n + max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except ConfigError:
        raise
    except Exception as e:  # missing, torn, bad JSON, bad header...
        return f"{type(e).__name__}: {e}"
    return "" if size == end else f"its arrays file holds {size} of {end} bytes"


def check_new_run_dir(run_dir: Path):
    """A new run never overwrites an existing one."""
    run_dir = Path(run_dir)
    if (run_dir / "latest.json").exists() or (run_dir / "metrics.jsonl").exists():
        raise ConfigError(f"run folder {run_dir} already holds a run; pass --resume to continue it, "
                          "or choose another --run-dir")
