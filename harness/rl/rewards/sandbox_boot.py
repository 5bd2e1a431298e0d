"""Inside the sandbox (started by sandbox.py, as PID 1 of its own PID namespace where the machine allows): confine a
child, run the code in it, reap, exit with its status. When this process ends, the kernel kills everything left in
the namespace, so a fork bomb's processes do not outlive the sample.

    python -I sandbox_boot.py SCRATCH LIMITS_JSON CODE_FILE

The child, before it execs the code: resource limits (CPU seconds, address space, processes, file size, no core
files), then as root a drop to the unprivileged `nobody` (so the process limit binds and nothing is root), then
Landlock: writes only beneath SCRATCH, no TCP connect or bind. Stand-alone: imports nothing from the harness."""

from __future__ import annotations

import json
import os
import resource
import sys

NOBODY = 65534
MIB = 1 << 20
LIMIT_EXIT = 125  # the confinement itself failed: the code never ran


def limit(scratch: str, limits: dict) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import landlock  # the sibling module, by file (the harness package is not imported here); before the drop:
    # the harness's interpreter may live where `nobody` cannot read

    cpu = int(limits["cpu_s"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (int(limits["memory_mb"]) * MIB,) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(limits["file_mb"]) * MIB,) * 2)
    resource.setrlimit(resource.RLIMIT_NPROC, (int(limits["processes"]),) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if os.geteuid() == 0 and limits.get("drop_root", True):
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
    if limits.get("landlock", True) and not landlock.restrict([scratch]) and limits.get("require_landlock"):
        raise OSError("Landlock is not available: writes outside the scratch folder would not be stopped")


def main(scratch: str, limits_json: str, code: str) -> int:
    """The code runs under limits["python"] (an interpreter `nobody` can read), never this process's own."""
    limits = json.loads(limits_json)
    pid = os.fork()
    if pid == 0:
        try:
            os.chdir(scratch)
            limit(scratch, limits)
            os.execv(limits["python"], [limits["python"], "-I", code])
        except BaseException as err:  # noqa: BLE001 - report why the confinement failed, then leave
            os.write(2, f"sandbox: confinement failed: {err!r}\n".encode())
        os._exit(LIMIT_EXIT)
    while True:  # PID 1 reaps every orphan until the code's own process ends
        done, status = os.wait()
        if done == pid:
            return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    code = main(*sys.argv[1:4])
    sys.exit(128 - code if code < 0 else code)
