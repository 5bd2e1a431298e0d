"""Start real DeepSpeed ranks for tests: `deepspeed --num_gpus N harness/run.py ...` on CPU."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from harness.dist import free_port

ROOT = Path(__file__).resolve().parents[2]
DEEPSPEED = Path(sys.executable).parent / "deepspeed"
JOB_MARK = "[tests/drivers/jobs.py] case "  # + the case's index: rank 0 prints it as each case starts


def env() -> dict:
    out = dict(os.environ)
    out.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1")
    # the venv's ninja first: the system's (another version) would invalidate DeepSpeed's cached JIT op builds
    out["PATH"] = f"{DEEPSPEED.parent}{os.pathsep}{out.get('PATH', '')}"
    return out


def command(*args: str, ranks: int = 2, script: str = "harness/run.py") -> list[str]:
    """DeepSpeed's `deepspeed` command as `harness launch` starts it (harness/commands/deepspeed_runner.py: the
    runner and its node's launcher skip the ~1.4 s mlflow import each); tests/test_quick_start.py runs the bare
    `deepspeed` command (DEEPSPEED) too."""
    return [sys.executable, "-m", "harness.commands.deepspeed_runner", "--master_port", str(free_port()),
            "--num_gpus", str(ranks), script, *args]


def start(*args: str, ranks: int = 2, log: Path) -> subprocess.Popen:
    """Start harness/run.py like `launch` without waiting (output to `log`), for tests that signal or kill it."""
    with open(log, "w") as out:
        return subprocess.Popen(command(*args, ranks=ranks), cwd=ROOT, env=env(), stdout=out, stderr=subprocess.STDOUT)


def launch(*args: str, ranks: int = 2, timeout_s: int = 600, check: bool = True,
           script: str = "harness/run.py") -> subprocess.CompletedProcess:
    """Run harness/run.py (or another script of the repository) on `ranks` CPU ranks through DeepSpeed's
    launcher; returns the finished process."""
    return run_checked(command(*args, ranks=ranks, script=script), timeout_s, check)


def run_checked(cmd: list[str], timeout_s: int, check: bool) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout_s)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}")
    return proc


def launch_jobs(cases: list, folder: Path, ranks: int = 2, timeout_s: int = 900,
                check: bool = True, launcher: bool = True) -> subprocess.CompletedProcess:
    """Run harness/run.py argument lists one after another in ONE process group (tests/drivers/jobs.py): the
    start-up (imports, process group) is paid once instead of once per case; a resume case goes after its run.
    A case {"argv": [...], "code": N} is a job expected to exit N; {"call": "drivers.MODULE:FUNCTION", "args": [...]}
    a driver's function run in the same process group. launcher=False with ranks 1: one plain python process (a world
    of one, as `python harness/run.py`), without the DeepSpeed launcher's own start-up."""
    path = Path(folder) / "cases.json"
    path.write_text(json.dumps([c if isinstance(c, dict) and "call" in c else
                                {"argv": [str(a) for a in c["argv"]], "code": c["code"]} if isinstance(c, dict)
                                else [str(a) for a in c] for c in cases]))
    if launcher or ranks != 1:
        return launch(str(path), ranks=ranks, timeout_s=timeout_s, check=check, script="tests/drivers/jobs.py")
    return run_checked([sys.executable, "tests/drivers/jobs.py", str(path)], timeout_s, check)


def set_args(sets: dict) -> list[str]:
    """`--set key=value` arguments of harness/run.py, one pair per key."""
    return [arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")]


def job_output(text: str, case: int) -> str:
    """Case `case`'s share of a launch_jobs stdout or stderr (from its mark to the next case's)."""
    parts = re.split(rf"^{re.escape(JOB_MARK)}(\d+)\n", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))[str(case)]


def records(run_dir: Path, kind: str) -> list[dict]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(run_dir, "train")}
