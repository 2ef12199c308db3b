"""Run metrics: one JSON line per evaluation (metrics.jsonl), and the run's summary."""

import json
from pathlib import Path

from .atomic import atomic_write_text


class MetricsLog:
    def __init__(self, path: Path):
        self.path = Path(path)

    def truncate_after(self, step: int):
        """On resume, drop rows written after the checkpoint: that work is being redone."""
        if self.path.exists():
            rows = [r for r in self.read(self.path) if r["step"] <= step]
            atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in rows))

    def write(self, row: dict):
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")

    @staticmethod
    def read(path) -> list:
        path = Path(path)
        if path.is_dir():
            path = path / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.3g} {unit}"
        n /= 1000
