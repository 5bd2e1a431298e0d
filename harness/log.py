"""Log lines in the design's format (`[tag]   text`), printed through tqdm so they do not break a progress bar.

Ground floor: every room may print a line (rank 0 only; callers check)."""

from __future__ import annotations

import sys


def say(tag: str, text: str) -> None:
    """A log line in the design's format: `[tag]   text` (rank 0 only; callers check)."""
    from tqdm import tqdm

    tqdm.write(f"[{tag}]{' ' * max(1, 8 - len(tag))}{text}", file=sys.stdout)
