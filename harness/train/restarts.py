"""What `harness launch --max-restarts N` needs to start a failed run again in the same run folder, and its log.

The run folder is chosen on the ranks (harness/train/job.py: --output-dir, else `<output_dir>/<date>_<recipe>[-N]`),
so rank 0 reports it to the wrapper through the exit-report folder (`run_dir.json`, beside the ranks' exit codes).
A restart then pins `--output-dir` to it, so it never starts a new folder, and:
  - with a complete checkpoint there, adds `--resume latest` (the newest complete one; an interrupted save has no
    manifest and is skipped) and drops `--overwrite`, which would let the resume replace later checkpoints;
  - with none (the run failed before its first save), starts from scratch in that folder: `--overwrite` clears the
    failed attempt's metrics and incomplete checkpoints (restarts.jsonl stays), unless the command already
    resumes another checkpoint (`--resume PATH`), which it then does again.
Each restart appends one line to RUN/restarts.jsonl (harness report shows them). Pure: files and strings only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from harness.checkpoint import files as ckpt_files
from harness.train.preempt import EXIT_DIR_ENV
from harness.train.run_args import parser as run_parser

RESTARTS = "restarts.jsonl"
RUN_DIR_REPORT = "run_dir.json"


def report_run_dir(run_dir: Path) -> None:
    """Rank 0: tell `harness launch` which run folder this attempt writes (by rename: whole or absent)."""
    folder = os.environ.get(EXIT_DIR_ENV)
    if not folder:
        return
    tmp = Path(folder) / f".{RUN_DIR_REPORT}.tmp"
    try:
        tmp.write_text(json.dumps({"run_dir": str(Path(run_dir).resolve())}))
        os.replace(tmp, Path(folder) / RUN_DIR_REPORT)
    except OSError:  # no wrapper listening any more
        pass


def reported_run_dir(exit_dir: Path) -> Path | None:
    try:
        return Path(json.loads((exit_dir / RUN_DIR_REPORT).read_text())["run_dir"])
    except (OSError, ValueError, KeyError):
        return None


def newest_complete(run_dir: Path) -> str | None:
    """The checkpoint `--resume latest` would load in run_dir (None: no complete checkpoint)."""
    ckpt = run_dir / "checkpoints"
    complete = [t for t in ckpt_files.tags(ckpt) if ckpt_files.is_complete(ckpt / t)] if ckpt.is_dir() else []
    return complete[-1] if complete else None


def _is_flag(token: str, flag: str) -> bool:
    """`token` names `flag` as argparse reads it: whole, `--flag=value`, or an unambiguous prefix (--overw)."""
    name = token.split("=", 1)[0]
    if name == flag:
        return True
    matches = [s for a in run_parser()._actions for s in a.option_strings if s.startswith(name)]
    return len(name) > 2 and matches == [flag]


def restart_args(script_args: list[str], run_dir: Path | None) -> tuple[list[str], str | None]:
    """(harness/run.py's arguments for the next attempt, the checkpoint it resumes or None). The last occurrence
    of a flag wins in argparse, so the pinned values are appended; --overwrite (store_true) is removed."""
    if run_dir is None:  # the attempt failed before rank 0 chose a folder: nothing to continue, start it again
        return list(script_args), None
    tag = newest_complete(run_dir)
    args = [a for a in script_args if not _is_flag(a, "--overwrite")]
    args += ["--output-dir", str(run_dir)]
    if tag is not None:
        return args + ["--resume", "latest"], tag
    given, _ = run_parser().parse_known_args(script_args)
    return (args if given.resume is not None else args + ["--overwrite"]), None


def append(run_dir: Path, record: dict) -> None:
    with open(run_dir / RESTARTS, "a") as f:
        f.write(json.dumps(record) + "\n")


def read(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / RESTARTS
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
