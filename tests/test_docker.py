"""docker/: what can be checked without a Docker engine or a GPU.

The Dockerfile's COPY sources exist, its base image carries the torch that constraints.txt pins, the
launch script is executable, parses, and turns its environment into the launcher command it documents,
and the example hostfile parses with DeepSpeed's own hostfile parser.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess

import pytest

from helpers.launch import ROOT

DOCKER = ROOT / "docker"
DOCKERFILE = DOCKER / "Dockerfile"
SCRIPT = DOCKER / "launch_multinode.sh"
KEYWORDS = {"FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME", "USER", "WORKDIR",
            "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL"}


def instructions() -> list[tuple[str, str]]:
    """(KEYWORD, arguments) per instruction: comments dropped, backslash continuations joined."""
    out, pending = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        keyword, _, rest = (pending + line).strip().partition(" ")
        out.append((keyword.upper(), rest.strip()))
        pending = ""
    assert not pending, "Dockerfile ends inside a continued line"
    return out


def build_args() -> dict[str, str]:
    """Default values of ARGs (`ARG NAME=value`)."""
    out = {}
    for keyword, rest in instructions():
        if keyword == "ARG" and "=" in rest:
            name, value = rest.split("=", 1)
            out[name] = value.strip('"')
    return out


def test_dockerfile_instructions_are_known_and_copies_exist():
    found = instructions()
    assert {k for k, _ in found} <= KEYWORDS, f"unknown instructions: {({k for k, _ in found}) - KEYWORDS}"
    copies = [shlex.split(rest) for keyword, rest in found if keyword in ("COPY", "ADD")]
    assert copies, "the Dockerfile copies nothing from the repository"
    for words in copies:
        words = [w for w in words if not w.startswith("--")]
        for source in words[:-1]:  # the last word is the destination
            assert (ROOT / source).exists(), f"COPY {source}: not in the repository (build context is its root)"


def test_base_image_is_cuda_devel_with_the_pinned_torch():
    pin = re.search(r"^torch==(\S+)", (ROOT / "constraints.txt").read_text(), re.M).group(1)
    base = build_args()["BASE_IMAGE"]
    match = re.fullmatch(r"pytorch/pytorch:(?P<torch>[\d.]+)-cuda(?P<cuda>[\d.]+)-cudnn\d+-devel", base)
    assert match, f"BASE_IMAGE {base}: expected an official pytorch/pytorch:<torch>-cuda<x.y>-cudnn<n>-devel tag"
    assert match["torch"] == pin, f"BASE_IMAGE has torch {match['torch']}, constraints.txt pins {pin}"
    assert match["cuda"].startswith("12.")
    text = DOCKERFILE.read_text()
    # pre-built ops need the CUDA op builders even though no GPU is visible at build time
    assert "DS_ACCELERATOR=cuda" in text and "TORCH_CUDA_ARCH_LIST" in build_args()
    apt = " ".join(rest for keyword, rest in instructions() if keyword == "RUN" and "apt-get install" in rest)
    assert all(pkg in apt.split() for pkg in ("libaio-dev", "openssh-client", "pdsh", "tini")), apt


def test_entrypoint_handles_pid_1():
    """PID 1 ignores SIGTERM without a handler: tini -g is PID 1 and signals the command's process group
    (tests/test_launch_signals.py runs `harness launch` as a real PID 1 and signals it)."""
    entry = [json.loads(rest) for keyword, rest in instructions() if keyword == "ENTRYPOINT"]
    assert entry == [["tini", "-g", "--"]], entry
    assert "harness launch" in (DOCKER / "README.md").read_text()


def test_launch_script_is_executable_and_parses():
    assert os.access(SCRIPT, os.X_OK), f"{SCRIPT} is not executable (git update-index --chmod=+x)"
    proc = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def run_script(tmp_path, **overrides) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "HOSTFILE")}
    env.update(DEEPSPEED="echo", **overrides)  # echo stands in for the launcher: shows the command it gets
    return subprocess.run([str(SCRIPT), "--recipe", "zero3", "--set", "train.steps=10"], cwd=tmp_path, env=env,
                          capture_output=True, text=True)


def test_launch_script_builds_the_no_ssh_command(tmp_path):
    proc = run_script(tmp_path, NODE_RANK="1", MASTER_ADDR="10.0.0.1",
                      HOSTFILE=str(DOCKER / "hostfile.example"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["--hostfile", str(DOCKER / "hostfile.example"), "--no_ssh", "--node_rank", "1",
                                   "--master_addr", "10.0.0.1", "--master_port", "29500", "harness/run.py",
                                   "--recipe", "zero3", "--set", "train.steps=10"]


def test_launch_script_names_what_is_missing(tmp_path):
    proc = run_script(tmp_path, MASTER_ADDR="10.0.0.1")
    assert proc.returncode != 0 and "NODE_RANK" in proc.stderr
    proc = run_script(tmp_path, NODE_RANK="0", MASTER_ADDR="10.0.0.1", HOSTFILE=str(tmp_path / "none"))
    assert proc.returncode == 2 and "hostfile" in proc.stderr and "not found" in proc.stderr


def test_hostfile_example_parses_with_deepspeed():
    from deepspeed.launcher.runner import fetch_hostfile

    pool = fetch_hostfile(str(DOCKER / "hostfile.example"))
    assert pool and len(pool) >= 2 and all(isinstance(n, int) and n > 0 for n in pool.values()), pool


def test_deepspeed_refuses_a_host_listed_twice():
    """Why two 'nodes' on one machine need two different labels (docker/README.md)."""
    from deepspeed.launcher.runner import _parse_hostfile

    with pytest.raises(ValueError, match="multiple entries for localhost"):
        _parse_hostfile(["localhost slots=1", "localhost slots=1"])


def test_one_dockerfile_two_targets():
    """TARGET=cuda (default, GPU nodes) or cpu (docker/build_cpu.sh; run by tests/test_docker_image.py): the file
    the Docker test builds is the one GPU nodes use. No `# syntax=` line: it makes the build pull BuildKit's
    frontend from a registry, which CI cannot reach."""
    assert build_args()["TARGET"] == "cuda"
    text = DOCKERFILE.read_text()
    assert not re.search(r"^#\s*syntax\s*=", text, re.M)
    assert re.search(r'cpu\) python_pkgs="[^"]*python3-dev', text), "the cpu target must install python3-dev"
    script = (DOCKER / "build_cpu.sh").read_text()
    assert "DOCKER_BUILDKIT=0" in script and "--build-arg TARGET=cpu" in script and "--build-arg BASE_IMAGE=" in script
    for path in (DOCKER / "build_cpu.sh", DOCKER / "build_base.sh"):
        assert os.access(path, os.X_OK), f"{path} is not executable"
        proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr


def test_build_context_filter_and_host_files():
    """The legacy builder reads .dockerignore only at the context root: a filter anywhere else would send .venv
    (GBs) to the daemon. What build_cpu.sh copies into docker/context/ (the torch wheel, the host's CA
    certificates) is never committed."""
    ignore = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "runs", ".cache"} <= set(ignore), ignore
    assert not (DOCKER / "Dockerfile.dockerignore").exists(), "BuildKit would prefer it to the root .dockerignore"
    assert "docker/context" not in " ".join(ignore)
    probe = ["docker/context/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl", "docker/context/proxy-ca.crt"]
    proc = subprocess.run(["git", "check-ignore", *probe, "docker/context/README.md"], cwd=ROOT, capture_output=True,
                          text=True)
    assert proc.stdout.split() == probe, proc.stdout
