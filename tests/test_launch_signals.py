"""SIGTERM to the process a person or a scheduler holds (issue #18): `harness launch ...` and the container's PID 1.

Each test starts the documented command in a process group of its own, waits for step 2, signals ONLY that one
process (not the group: a container runtime or a job step signals one process), and asserts that when it returns
(within 40 s) the ranks stopped at one agreed step, a complete checkpoint is there (`latest` names it, its
manifest.json exists), no process of the tree is left, and the exit code is 75, which only the ranks' own
reports give (DeepSpeed's launcher exits 1 after a signal, the runner dies of it: 143).

The container case runs the image's entrypoint command in a new PID namespace (`unshare --pid --fork
--mount-proc`), where it really is PID 1: the kernel ignores a signal it has no handler for, orphans reparent to
it, and when it exits the kernel kills everything left in the namespace, exactly what `docker stop` does to a
container. A plain child of the test would have none of these properties, so it would prove nothing about PID 1.
The image's entrypoint is `tini -g --`; when tini is installed here it is PID 1 as in the image, otherwise
`harness launch` itself is (which it must also survive: `docker run --entrypoint harness IMAGE launch ...`).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from harness.commands.launch import ranks_code
from harness.dist import Launch, free_port
from harness.train.preempt import EXIT_DIR_ENV, report_exit
from helpers.launch import ROOT, env, records
from helpers.reliability import latest_is_complete, train_steps_logged, tree, wait_for

HARNESS = Path(sys.executable).parent / "harness"
GRACE_S = 40
ARGS = ["--recipe", "zero2", "--set", "precision=fp32", "--set", "train.seq_len=64", "--set", "train.eval_every=0",
        "--set", "batch.micro_batch_per_gpu=4", "--set", "batch.grad_accum_steps=1", "--set", "train.steps=200",
        "--set", "train.log_every=1", "--profile-steps", ""]


def launch_command(run: Path) -> list[str]:
    return [str(HARNESS), "launch", "--master_port", str(free_port()), "--num_gpus", "2", "harness/run.py", *ARGS,
            "--output-dir", str(run)]


def pid_namespace_problem() -> str | None:
    try:
        probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, text=True,
                               timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare: {e}"
    return None if probe.returncode == 0 else f"unshare --pid needs root or user namespaces: {probe.stderr.strip()}"


def signal_one_and_check(cmd: list[str], run: Path, log: Path, target) -> str:
    """Start cmd, SIGTERM the process `target(proc)` names once step 2 is logged; check what is left."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**env(), "PYTHONPATH": str(ROOT)}, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: train_steps_logged(run) >= 2 or proc.poll() is not None, 300, "step 2", poll_s=0.05)
        everyone = tree(proc.pid)
        victim = target(proc)
        sent = time.monotonic()
        os.kill(victim, signal.SIGTERM)
        proc.wait(timeout=120)
        returned_s = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    left = [p for p in everyone if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"still running after the command returned: {[p.cmdline() for p in left]}\n{text[-3000:]}"
    assert proc.returncode == 75, f"exit {proc.returncode}, want 75 (preempted)\n{text[-3000:]}"
    assert returned_s <= GRACE_S, f"returned {returned_s:.1f} s after SIGTERM (grace {GRACE_S} s)"
    stopped = records(run, "preempted")
    assert len(stopped) == 1, text[-3000:]
    tag = latest_is_complete(run / "checkpoints")
    assert tag == f"global_step{stopped[0]['step']}", (tag, stopped)
    return f"checkpoint {tag}, exit 75, {len(everyone)} processes gone {returned_s:.1f} s after SIGTERM"


@pytest.mark.multirank
def test_sigterm_to_harness_launch_waits_for_the_ranks_save_and_returns_75(tmp_path):
    run = tmp_path / "run"
    said = signal_one_and_check(launch_command(run), run, tmp_path / "launch.log", target=lambda proc: proc.pid)
    print(f"harness launch: {said}")


@pytest.mark.multirank
def test_sigterm_to_the_containers_pid_1_reaches_the_ranks(tmp_path):
    problem = pid_namespace_problem()
    if problem:
        pytest.skip(problem)
    tini = shutil.which("tini")
    entry = [tini, "-g", "--"] if tini else []  # docker/Dockerfile: ENTRYPOINT ["tini", "-g", "--"]
    run = tmp_path / "run"
    cmd = ["unshare", "--pid", "--fork", "--mount-proc", *entry, *launch_command(run)]

    def pid_1(proc):  # unshare's only child is PID 1 of the new namespace
        return wait_for(lambda: next(iter(psutil.Process(proc.pid).children()), None), 10, "PID 1").pid

    said = signal_one_and_check(cmd, run, tmp_path / "pid1.log", target=pid_1)
    print(f"PID 1 = {'tini -g' if tini else 'harness launch'}: {said}")


def test_exit_code_comes_from_the_ranks_reports(tmp_path, monkeypatch):
    """The rules `harness launch` applies to what the ranks report (the launcher's own code is the fallback)."""
    def reported(*codes, local=2):
        folder = tmp_path / f"case{len(list(tmp_path.iterdir()))}"
        folder.mkdir()
        monkeypatch.setenv(EXIT_DIR_ENV, str(folder))
        for rank, code in enumerate(codes):
            report_exit(code, Launch(world_size=local, local_size=local, rank=rank))
            time.sleep(0.01)  # reports are ordered by mtime: the first failure wins
        return folder

    assert ranks_code(reported(75, 75), fallback=1) == 75  # preempted: the launcher's 1 is not the answer
    assert ranks_code(reported(0, 75), fallback=1) == 75
    assert ranks_code(reported(0, 0), fallback=0) == 0
    assert ranks_code(reported(2, 1), fallback=1) == 2  # the first failure, not the ones it caused
    assert ranks_code(reported(75, 1), fallback=1) == 1
    assert ranks_code(reported(0), fallback=143) == 143  # a rank left no report (killed): the runner's code
    assert ranks_code(reported(0, local=1), fallback=1) == 0
    assert ranks_code(reported(), fallback=143) == 143
