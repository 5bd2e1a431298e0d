"""Tests marked `docker` need a Docker daemon (tests/test_docker_image.py says what else); where it is missing they
are skipped with the reason. CI (.ci/run) starts one and sets DSHARNESS_REQUIRE_DOCKER=1: there they always run.

Tests marked `nvme` need DeepSpeed's async_io op (libaio). Where it cannot load here they are skipped with the
reason (setup.cfg's `-rs` prints it), decided by the same function the run-time checks and `harness doctor`
use. CI installs libaio-dev and sets DSHARNESS_REQUIRE_NVME=1: there they always run, and fail if it is missing.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

SHM_BUFFERS = "deepspeed_allreduce_buffer_*"  # DeepSpeed's CPU shm all-reduce buffer: ~66 MB of RAM each
_SESSION_START = time.time()


def pytest_sessionfinish(session, exitstatus):
    """Remove the shm all-reduce buffers of ranks this session started that died before harness.dist unlinked
    theirs (a rank killed or failed while the group formed; raw-DeepSpeed drivers): DeepSpeed never unlinks them,
    and /dev/shm is RAM, kept until reboot (7.7 GB had piled up on this machine in a day of test runs). Only files
    made during the session and idle for 2 minutes: a live group's buffers are unlinked seconds after they appear."""
    now, removed = time.time(), []
    for path in Path("/dev/shm").glob(SHM_BUFFERS):
        try:
            if _SESSION_START <= path.stat().st_mtime < now - 120:
                path.unlink()
                removed.append(path.name)
        except OSError:
            pass
    if removed:  # said, so a test that leaks one can be found
        print(f"\nconftest: removed {len(removed)} leaked /dev/shm buffer(s): {', '.join(sorted(removed))}")


@pytest.fixture(scope="session")
def zero2_uninterrupted(tmp_path_factory):
    """The run folder of 2 ranks, zero2 fp32, helpers/reliability.TOTAL steps uninterrupted (deepspeed directly):
    the reference of the preemption and resume tests (its losses) and of the restart tests (its last checkpoint)."""
    from helpers.launch import launch
    from helpers.reliability import COMMON, TOTAL, steps

    run = tmp_path_factory.mktemp("z2") / "straight"
    launch("--recipe", "zero2", "--output-dir", str(run), *COMMON, *steps(TOTAL))
    return run


@pytest.fixture(scope="session")
def nvme_runs(tmp_path_factory):
    """The NVMe runs of test_training and test_profiling in ONE launch (tests/helpers/nvme.py): their root, run
    folders by name. Asked for by `nvme` tests only, so where those are skipped (no libaio) it never launches."""
    from helpers.nvme import launch_nvme_runs

    return launch_nvme_runs(tmp_path_factory.mktemp("nvme"))


@pytest.fixture(scope="session")
def distill_runs(tmp_path_factory):
    """The distillation tests' runs (test_distill, test_distill_topk_run, test_teacher_store) in ONE 2-rank launch
    (tests/helpers/distill_launch.py): its root, process, wall time and each case's output by name."""
    from helpers.distill_launch import launch_distill_runs

    return launch_distill_runs(tmp_path_factory.mktemp("distill"))


@pytest.fixture(scope="session")
def optim_engines_2(tmp_path_factory):
    """tests/drivers/optim_engines.py on 2 ranks in ONE launch for tests/test_optimizers.py (bytes, muon) and
    tests/test_lowbit.py (lowbit): (its folder, each rank's results)."""
    import json

    from helpers.launch import launch

    out = tmp_path_factory.mktemp("optim_engines") / "engines2.json"
    os.environ["TORCHDYNAMO_DISABLE"] = "1"  # DeepSpeed's muon_update and torchao's step are torch.compile'd
    try:
        launch(str(out), "bytes", "muon", "lowbit", ranks=2, script="tests/drivers/optim_engines.py", timeout_s=600)
    finally:
        del os.environ["TORCHDYNAMO_DISABLE"]
    return out.parent, [json.loads(out.with_name(f"engines2.json.rank{r}").read_text()) for r in range(2)]


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A real one-node Slurm cluster (tests/helpers/slurm_cluster.py), up for the session, stopped after. Where
    it cannot start (not root, Slurm not installed) the tests skip with the reason, except in CI (CI or
    DSHARNESS_REQUIRE_SLURM=1, which .ci/run sets after installing Slurm): there they fail with it."""
    from helpers import slurm_cluster as slurm

    problem = slurm.slurm_problem()
    if problem is not None:
        if slurm.required():
            pytest.fail(f"Slurm is required here ({slurm.REQUIRE_ENV}=1 or CI set) but cannot start: {problem}")
        pytest.skip(f"no Slurm cluster here: {problem} (CI sets {slurm.REQUIRE_ENV}=1)")
    cluster = slurm.start(tmp_path_factory.mktemp("slurm"))
    yield cluster
    cluster.stop()


def pytest_collection_modifyitems(config, items):
    skip_docker(items)
    nvme = [item for item in items if item.get_closest_marker("nvme")]
    if not nvme or os.environ.get("DSHARNESS_REQUIRE_NVME") == "1":
        return
    from harness.ops import op_problem

    problem = op_problem("async_io")
    if problem is not None:
        skip = pytest.mark.skip(reason=f"NVMe offload cannot run here: {problem[0]} (fix: {problem[1]})")
        for item in nvme:
            item.add_marker(skip)


def skip_docker(items):
    docker = [item for item in items if item.get_closest_marker("docker")]
    if not docker or os.environ.get("DSHARNESS_REQUIRE_DOCKER") == "1":
        return
    from helpers.docker_daemon import docker_problem

    problem = docker_problem()
    if problem is not None:
        skip = pytest.mark.skip(reason=f"Docker cannot run here: {problem} (CI sets DSHARNESS_REQUIRE_DOCKER=1)")
        for item in docker:
            item.add_marker(skip)
