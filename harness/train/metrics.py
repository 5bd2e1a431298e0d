"""Run outputs written by rank 0: metrics.jsonl (one JSON object per event) and summary.json."""

from __future__ import annotations

import json
import time
from pathlib import Path


class MetricsLog:
    """Append-only JSONL; every record carries its kind ("train", "eval", "profile", ...) and step."""

    def __init__(self, run_dir: Path, enabled: bool):
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self._file = open(self.path, "a") if enabled else None

    def write(self, kind: str, step: int, at: float | None = None, **fields) -> None:
        """`at`: when the event happened (time.time()), if earlier than now (train records are written in
        batches at each flush)."""
        if self._file:
            stamp = round(time.time() if at is None else at, 3)
            self._file.write(json.dumps({"kind": kind, "step": step, "time": stamp, **fields}) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file:
            self._file.close()
            self._file = None


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
