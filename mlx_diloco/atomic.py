"""Atomic file writes: write to a temporary file in the same folder, fsync, then rename."""

import os
import tempfile
from pathlib import Path


def atomic_write_bytes(path, data: bytes, durable: bool = True):
    """`durable=False` skips the fsync: for small files rewritten often, where a crash may lose the
    newest version but must never leave a torn one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path, text: str, durable: bool = True):
    atomic_write_bytes(path, text.encode("utf-8"), durable)
