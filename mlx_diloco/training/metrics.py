"""A run's metrics file (metrics.jsonl, one JSON row per evaluation): written, trimmed on resume,
and read back; and byte counts as people read them."""

import json
from pathlib import Path

from ..atomic import atomic_write_text
from ..config import ConfigError
from ..records import ROW


class MetricsLog:
    def __init__(self, path: Path):
        self.path = Path(path)

    def truncate_after(self, step: int):
        """On resume, drop rows written after the checkpoint: that work is being redone."""
        if self.path.exists():
            rows = [r for r in self.read(self.path) if r[ROW.step] <= step]  # (an exchange row's step: the same key)
            atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in rows))

    def write(self, row: dict):
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")

    @staticmethod
    def read(path) -> list:
        """The rows of a metrics.jsonl (or of a run folder's); a ConfigError if it is not one."""
        path = Path(path)
        if path.is_dir():
            path = path / "metrics.jsonl"

        def not_metrics(why: str):
            return ConfigError(f"{path} is not a metrics file written by mlx-diloco ({why}); "
                               "pass run folders or their metrics.jsonl")
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            raise not_metrics("it is not text") from None
        rows = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    raise not_metrics(f"line {n} is not JSON") from None
                if not isinstance(rows[-1], dict) or "step" not in rows[-1]:
                    raise not_metrics(f"line {n} has no 'step'")
        return rows


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.3g} {unit}"
        n /= 1000
