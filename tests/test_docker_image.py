"""The CPU image of docker/Dockerfile built and run by a real Docker daemon (issue #25).

docker/build_cpu.sh builds it once per session (module fixture; Docker's layer cache makes a rebuild with
unchanged files take seconds). Then `harness launch` trains the built-in tiny model on 2 CPU ranks in a
container with its run folder on a bind mount; `docker stop` (SIGTERM to the image's PID 1, `tini -g`) must end it
with exit code 75 and a complete checkpoint well inside the grace period, without a rank having compiled a
DeepSpeed op (the image holds them built); a new container with `--resume latest` finishes the run, and every
loss equals that of a container that ran straight through (bit for bit up to the first step after the resume,
within 1e-6 relative after it).

Marked `docker`: skipped with the reason where no daemon answers (tests/conftest.py); .ci/run starts one and
sets DSHARNESS_REQUIRE_DOCKER=1, which turns that skip into a failure.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.docker_daemon import docker_problem
from helpers.launch import ROOT, losses, records
from helpers.reliability import (COMMON, assert_continues, latest_is_complete, steps, train_steps_logged,
                                 wait_for)

pytestmark = [pytest.mark.docker, pytest.mark.multirank]

IMAGE = "dsharness:cpu"
BUILD = ROOT / "docker" / "build_cpu.sh"
STOP_GRACE_S = 60
RTOL = 1e-6  # fp32 losses after the first resumed step
ENV = ["-e", "OMP_NUM_THREADS=1", "-e", "TOKENIZERS_PARALLELISM=false", "-e", "HF_HUB_OFFLINE=1",
       "-e", "HF_DATASETS_OFFLINE=1"]


def docker(*args: str, timeout_s: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout_s)
    if check and proc.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} exited {proc.returncode}\n{proc.stdout[-3000:]}"
                             f"\n{proc.stderr[-3000:]}")
    return proc


@pytest.fixture(scope="module")
def cpu_image() -> str:
    if problem := docker_problem():
        pytest.fail(f"the Docker test must run here (DSHARNESS_REQUIRE_DOCKER=1) but cannot: {problem}")
    start = time.monotonic()
    proc = subprocess.run([str(BUILD), IMAGE], env={**os.environ, "PYTHON": sys.executable}, capture_output=True,
                          text=True, timeout=2400)
    assert proc.returncode == 0, f"{BUILD} exited {proc.returncode}\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    summary = [line for line in proc.stdout.splitlines() if line.startswith(("[base]", "[build]"))]
    print(f"image {IMAGE} ready in {time.monotonic() - start:.0f} s:", *summary, sep="\n  ")
    return IMAGE


@pytest.fixture
def runs(tmp_path):
    """The bind-mounted folder, and the containers started in it: removed at the end, their root-owned files
    handed back to this user first so that pytest can delete tmp_path."""
    folder = tmp_path / "runs"
    folder.mkdir()
    names: list[str] = []
    yield folder, names
    for name in names:
        docker("rm", "-f", name, check=False)
    docker("run", "--rm", "--entrypoint", "chown", "-v", f"{folder}:/runs", IMAGE, "-R",
           f"{os.getuid()}:{os.getgid()}", "/runs", check=False)


def run_args(name: str, folder: Path, out: str, *args: str, detach: bool = False) -> list[str]:
    """`docker run` of `harness launch` on 2 CPU ranks writing to /runs/<out>. --shm-size: DeepSpeed's CPU
    all-reduce goes through /dev/shm (docker/README.md)."""
    return ["run", *(["-d"] if detach else []), "--name", name, "--shm-size=1g", "-v", f"{folder}:/runs", *ENV, IMAGE,
            "harness", "launch", "--num_gpus", "2", "harness/run.py", "--recipe", "zero2", *COMMON,
            "--output-dir", f"/runs/{out}", *args]


def run_to_the_end(name: str, folder: Path, out: str, *args: str) -> None:
    proc = docker(*run_args(name, folder, out, *args), timeout_s=600, check=False)
    assert proc.returncode == 0, f"{name} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-3000:]}"


def built_at_run_time(name: str) -> list[str]:
    """Files of compiled ops the container added to the image's torch extensions cache (`docker diff`)."""
    changed = docker("diff", name).stdout.split("\n")
    return [line for line in changed if "/opt/torch_extensions/" in line and line.endswith((".so", ".o"))]


@pytest.mark.timeout(2400)  # the first build in a session takes about 10 min of it
def test_docker_stop_saves_and_a_new_container_resumes_exactly(cpu_image, runs):
    folder, names = runs
    tag = f"dsharness-test-{os.getpid()}"
    names += [f"{tag}-preempted", f"{tag}-resumed", f"{tag}-straight"]
    started = time.monotonic()
    docker(*run_args(names[0], folder, "preempted", *steps(200), detach=True))
    running = lambda: docker("inspect", "-f", "{{.State.Running}}", names[0]).stdout.strip() == "true"  # noqa: E731
    wait_for(lambda: train_steps_logged(folder / "preempted") >= 2 or not running(), 300, "step 2 in the container",
             poll_s=0.1)
    first_steps_s = time.monotonic() - started
    sent = time.monotonic()
    docker("stop", "-t", str(STOP_GRACE_S), names[0], timeout_s=STOP_GRACE_S + 30)
    stop_s = time.monotonic() - sent
    print(f"docker: step 2 {first_steps_s:.1f} s after `docker run -d`; `docker stop` returned in {stop_s:.1f} s")
    code = int(docker("inspect", "-f", "{{.State.ExitCode}}", names[0]).stdout)
    log = docker("logs", names[0]).stdout + docker("logs", names[0]).stderr
    assert code == 75, f"docker stop: exit {code}, want 75 (preempted) after {stop_s:.1f} s\n{log[-4000:]}"
    assert stop_s < STOP_GRACE_S / 2, f"docker stop took {stop_s:.1f} s of its {STOP_GRACE_S} s grace"
    stopped = records(folder / "preempted", "preempted")
    assert len(stopped) == 1, log[-4000:]
    k = stopped[0]["step"]
    assert latest_is_complete(folder / "preempted" / "checkpoints") == f"global_step{k}" and k >= 2, k
    assert not built_at_run_time(names[0]), f"ops compiled in the container: {built_at_run_time(names[0])}"

    run_to_the_end(names[1], folder, "preempted", "--resume", "latest", *steps(k + 3))
    run_to_the_end(names[2], folder, "straight", *steps(k + 3))
    resumed, straight = losses(folder / "preempted"), losses(folder / "straight")
    assert sorted(resumed) == list(range(1, k + 4)), sorted(resumed)
    # bit for bit up to the first step after the resume (it runs on the saved weights); after it within fp32
    # rounding, as the host's resume test allows (tests/test_reliability.py): measured 8e-8 relative here
    assert {s: resumed[s] for s in range(1, k + 2)} == {s: straight[s] for s in range(1, k + 2)}, (resumed, straight)
    worst = assert_continues({s: resumed[s] for s in range(k + 2, k + 4)}, straight, RTOL)
    print(f"docker: exit 75, checkpoint at step {k}; resumed to step {k + 3}: steps 1-{k + 1} equal a straight "
          f"run's, then "          f"{worst:.1e} relative")
