"""Run untrusted code (the `code` built-in reward) in a separate, confined process.

What confines it, on this machine kind (Linux):
- a new network namespace (no interface but a down loopback: nothing reachable, 127.0.0.1 of the host included)
  and a new PID namespace whose init is sandbox_boot.py: when it ends, every process the code started is killed;
  started with util-linux `unshare` (as root directly; as another user inside a new user namespace, where the
  kernel allows unprivileged user namespaces);
- resource limits on the code's process: CPU seconds (SIGXCPU then SIGKILL), address space, processes (a fork bomb
  stops at the limit), file size, no core files; as root the code runs as `nobody` (the process limit counts that
  user's processes, and nothing runs as root);
- Landlock (Linux 5.13+, no privileges needed): writes only beneath the scratch folder; on Linux 6.7+ no TCP connect
  or bind either, which keeps the network shut where namespaces are not available;
- the code runs under the machine's python3 (rl.sandbox.python), not the harness's environment;
- a wall-clock timeout after which the whole process group is killed; the scratch folder is deleted after.

A user who is not root, on a kernel without unprivileged user namespaces, gets the limits and Landlock only (no
namespaces: UDP and unix sockets stay open, and a process that leaves the process group outlives the sample until
its CPU limit). Without Landlock the sandbox refuses to run code (exit 125, "confinement failed") unless
rl.sandbox.require_landlock is false. `status()` says which layers this machine gives; docs/rl.md lists them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from harness.rl.rewards import landlock

BOOT = Path(__file__).resolve().parent / "sandbox_boot.py"
DEFAULTS = {"cpu_s": 5, "memory_mb": 512, "processes": 32, "file_mb": 16, "timeout_s": 10.0, "python": "python3",
            "require_landlock": True}
SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"  # where the code's interpreter is looked up (not the harness's venv)
OUTPUT_BYTES = 64 * 1024  # of stdout and stderr kept per run


@dataclass(frozen=True)
class Result:
    returncode: int  # the code's exit status; 128 + N when killed by signal N; -9 when the wall timeout hit
    stdout: str
    stderr: str
    timed_out: bool
    wall_s: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


def _unshare_prefix() -> list[str]:
    """The namespaces this process may create, as an `unshare` command line ([] when none)."""
    tool = shutil.which("unshare")
    if tool is None:
        return []
    base = [tool, "--net", "--pid", "--fork", "--kill-child"]
    for prefix in (base, [tool, "--user", "--map-root-user", *base[1:]]) if os.geteuid() == 0 else \
            ([tool, "--user", "--map-root-user", *base[1:]],):
        if subprocess.run([*prefix, "true"], capture_output=True).returncode == 0:
            return prefix
    return []


_PREFIX: list[str] | None = None


def prefix() -> list[str]:
    global _PREFIX
    if _PREFIX is None:
        _PREFIX = _unshare_prefix()
    return _PREFIX


def status() -> dict:
    """Which confinement layers this machine gives (for the start-up lines and the docs)."""
    ns = prefix()
    return {"namespaces": bool(ns), "user_namespace": "--user" in ns, "landlock_abi": landlock.abi(),
            "runs_as": "nobody" if os.geteuid() == 0 and "--user" not in ns else "this user"}


def run(code: str, *, limits: dict | None = None, stdin: str = "") -> Result:
    """Run Python `code` confined; its scratch folder is its working directory and only writable place."""
    limits = {**DEFAULTS, **(limits or {})}
    limits["python"] = shutil.which(limits["python"], path=SAFE_PATH) or limits["python"]
    scratch = tempfile.mkdtemp(prefix="sandbox-")
    try:
        path = Path(scratch) / "main.py"
        path.write_text(code)
        if os.geteuid() == 0 and "--user" not in prefix():
            os.chown(scratch, 65534, 65534)
            os.chown(path, 65534, 65534)
        limits["drop_root"] = "--user" not in prefix()
        cmd = [*prefix(), sys.executable, "-I", str(BOOT), scratch, json.dumps(limits), str(path)]
        env = {"PATH": SAFE_PATH, "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8"}
        began = time.perf_counter()
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                cwd=scratch, env=env, start_new_session=True)
        timed_out = False
        try:
            out, err = proc.communicate(stdin.encode(), timeout=float(limits["timeout_s"]))
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        _kill_group(proc.pid)
        return Result(proc.returncode if not timed_out else -9, out[:OUTPUT_BYTES].decode(errors="replace"),
                      err[:OUTPUT_BYTES].decode(errors="replace"), timed_out, time.perf_counter() - began)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _group(pgid: int) -> list[int]:
    """The processes of a process group (from /proc/PID/stat's pgrp field)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.append(int(entry))
    return out


def _kill_group(pgid: int, wait_s: float = 3.0) -> None:
    """Kill whatever the code left in its process group and wait until it is gone (without a PID namespace nothing
    else ends it; with one, the kernel's kills are asynchronous)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            return
        if not _group(pgid) or time.monotonic() > deadline:
            return
        time.sleep(0.05)
