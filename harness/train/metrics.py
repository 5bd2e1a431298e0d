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
        if enabled:
            drop_partial_line(self.path)
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


def drop_partial_line(path: Path) -> None:
    """A rank killed mid-write (kill -9, then a restart that appends) can leave a last line without its newline;
    cut it, so the next record starts on a line of its own and every line stays JSON."""
    try:
        with open(path, "rb+") as f:
            end = pos = f.seek(0, 2)
            while pos > 0:
                size = min(65536, pos)
                f.seek(pos - size)
                chunk = f.read(size)
                if pos == end and chunk.endswith(b"\n"):
                    return
                if b"\n" in chunk:
                    f.truncate(pos - size + chunk.rfind(b"\n") + 1)
                    return
                pos -= size
            f.truncate(0)
    except FileNotFoundError:
        pass


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
