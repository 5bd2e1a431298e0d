"""A finished run resumed (issue 41 item 5): `latest` is already at train.steps. It must say that the run is complete,
write nothing and exit 0, so `harness launch --max-restarts` does not restart it and a Slurm job requeued after its
last step (or resubmitted) ends COMPLETED: the batch script (harness/assets/slurm.sbatch) adds `--resume latest`
whenever `latest` exists and exits with `harness launch`'s code, which is what the launch below runs. Reuses the
session's uninterrupted zero2 run (tests/conftest.py), copied so that nothing can change the shared reference."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.launch import ROOT, env
from helpers.reliability import COMMON, TOTAL, steps

COMPLETE = (f"global_step{TOTAL} is step {TOTAL}, its last step: the run is complete, nothing to train and nothing "
            "written")


def snapshot(run: Path) -> dict:
    return {str(p.relative_to(run)): (p.stat().st_size, p.stat().st_mtime_ns) for p in run.rglob("*")}


@pytest.fixture
def finished(zero2_uninterrupted, tmp_path):
    run = tmp_path / "finished"
    shutil.copytree(zero2_uninterrupted, run)
    return run


@pytest.mark.multirank
def test_a_finished_run_resumed_says_so_writes_nothing_and_exits_0(finished, capsys):
    from harness.dist import ONE_PROCESS
    from harness.run import main

    before = snapshot(finished)
    args = ["--recipe", "zero2", *COMMON, *steps(TOTAL), "--output-dir", str(finished), "--resume", "latest"]
    assert main(args, launch=ONE_PROCESS) == 0  # harness/run.py in this process: no rank needs to start
    assert COMPLETE in capsys.readouterr().out
    harness = Path(sys.executable).parent / "harness"
    proc = subprocess.run([str(harness), "launch", "--max-restarts", "2", "--num_gpus", "2", "harness/run.py", *args],
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert COMPLETE in proc.stdout and "Traceback" not in proc.stderr, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert snapshot(finished) == before  # no summary, metrics, recipe copy, restarts.jsonl or checkpoint written
    shorter = main([*args, *steps(TOTAL - 2)], launch=ONE_PROCESS)  # a checkpoint past train.steps: complete too
    assert shorter == 0 and f"is step {TOTAL}, past train.steps {TOTAL - 2}" in capsys.readouterr().out


def test_resume_auto_starts_fresh_then_the_same_command_continues(finished, tmp_path, capsys):
    """--resume auto (issue 48: a restarted pod or `harness ray`'s relaunch reruns one command): with a complete
    checkpoint in --output-dir it is --resume latest, without one a fresh start; without --output-dir, exit 2."""
    from harness.dist import ONE_PROCESS
    from harness.run import main

    args = ["--recipe", "zero2", *COMMON, *steps(TOTAL), "--output-dir", str(finished), "--resume", "auto"]
    assert main(args, launch=ONE_PROCESS) == 0 and COMPLETE in capsys.readouterr().out
    assert main(["--recipe", "ddp", "--resume", "auto"], launch=ONE_PROCESS) == 2
    err = capsys.readouterr().err
    assert "--resume auto needs --output-dir" in err and "fix: --output-dir RUN_DIR --resume auto" in err, err
    run = tmp_path / "fresh"
    command = [sys.executable, "harness/run.py", "--recipe", "ddp", *COMMON, *steps(2), "--output-dir", str(run),
               "--resume", "auto"]
    first = subprocess.run(command, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert first.returncode == 0 and (run / "checkpoints" / "global_step2" / "manifest.json").exists(), \
        first.stdout[-2000:] + first.stderr[-2000:]
    again = subprocess.run(command, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "global_step2 is step 2, its last step: the run is complete" in again.stdout, \
        again.stdout[-2000:] + again.stderr[-2000:]
