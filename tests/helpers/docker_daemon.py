"""Whether a Docker daemon can build and run the CPU image here: tests/conftest.py skips the `docker`
tests with its answer, and tests/test_docker_image.py fails with it where CI requires Docker."""

from __future__ import annotations

import os
import shutil
import subprocess


def docker_problem() -> str | None:
    """Why the image cannot be built and run here, or None. tests/conftest.py skips the tests with it."""
    if shutil.which("docker") is None:
        return "no docker command (apt-get install docker.io; .ci/run installs it)"
    try:
        info = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True,
                              timeout=30)
    except subprocess.TimeoutExpired:
        return "`docker info` did not answer in 30 s"
    if info.returncode != 0:
        first = (info.stderr.strip().splitlines() or ["?"])[0]
        return f"no Docker daemon answers ({first}); start dockerd (.ci/run does, logging to .cache/dockerd.log)"
    base = subprocess.run(["docker", "image", "inspect", "dsharness-base:bookworm"], capture_output=True)
    if base.returncode != 0 and (shutil.which("debootstrap") is None or os.geteuid() != 0):
        return "the base image dsharness-base:bookworm is missing and building it needs root and debootstrap"
    return None
