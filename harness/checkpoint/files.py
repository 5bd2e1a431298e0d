"""Checkpoint folders as files: names, completeness, `latest`, retention. Pure (no torch), so the session can
decide what a resume loads before any rank starts. The layout is described in harness/checkpoint/save.py."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

MANIFEST = "manifest.json"
LATEST = "latest"
PREFIX = "global_step"
UNIVERSAL = "universal"  # checkpoints/universal/global_stepN: the converted form (harness/checkpoint/resume.py)


def tag_for(step: int) -> str:
    return f"{PREFIX}{step}"


def step_of(tag: str) -> int | None:
    rest = tag[len(PREFIX):] if tag.startswith(PREFIX) else ""
    return int(rest) if rest.isdigit() else None


def is_complete(folder: Path) -> bool:
    return (folder / MANIFEST).is_file()


def latest_tag(ckpt_dir: Path) -> str | None:
    """The tag `latest` names, when that checkpoint is complete (None: no latest, or a dangling one)."""
    try:
        tag = (Path(ckpt_dir) / LATEST).read_text().strip()
    except OSError:
        return None
    return tag if tag and is_complete(Path(ckpt_dir) / tag) else None


def read_manifest(folder: Path) -> dict:
    return json.loads((folder / MANIFEST).read_text())


def tags(ckpt_dir: Path) -> list[str]:
    """Every global_stepN folder, complete or not, oldest first."""
    found = [p.name for p in ckpt_dir.glob(f"{PREFIX}*") if p.is_dir() and step_of(p.name) is not None]
    return sorted(found, key=step_of)


def write_atomic(path: Path, text: str) -> None:
    """Write by rename: a reader (or a kill at any moment) sees the old content or the new, never a part."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def prune(ckpt_dir: Path, keep_last: int) -> list[str]:
    """Keep the newest keep_last complete checkpoints (0 = all). Called right after a save completed, so the
    newest complete one is never among the deleted; incomplete folders older than it go too (never loadable)."""
    if keep_last <= 0:
        return []
    all_tags = tags(ckpt_dir)
    complete = [t for t in all_tags if is_complete(ckpt_dir / t)]
    if not complete:
        return []
    keep = set(complete[-keep_last:])
    newest = step_of(complete[-1])
    doomed = [t for t in all_tags if t not in keep and step_of(t) < newest]
    for tag in doomed:
        shutil.rmtree(ckpt_dir / UNIVERSAL / tag, ignore_errors=True)
        shutil.rmtree(ckpt_dir / tag, ignore_errors=True)
    return doomed


def later_tags(ckpt_dir: Path, step: int) -> list[str]:
    """Complete checkpoints after `step` (a resume from `step` would overwrite them)."""
    return [t for t in tags(ckpt_dir) if step_of(t) > step and is_complete(ckpt_dir / t)]
