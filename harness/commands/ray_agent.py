"""One node's agent of `harness ray` (harness/commands/ray.py): a Ray actor, one per node in the driver's
placement group, that runs that node's `harness launch --no_ssh --node_rank i ...` as a subprocess.

The launch runs in a session of its own (Ray ends an actor's direct children when the actor ends, not a process
of another session, and `harness launch` starts its runner in a session of its own too), so the agent ends the
whole tree itself: stop() kills every process of it (a failed attempt is abandoned; its latest complete
checkpoint is what the next attempt resumes). Should the actor die first (the driver gone, `ray job stop`), the
launch gets SIGTERM from the kernel (PR_SET_PDEATHSIG), which it forwards to its ranks: they save at one agreed
step and exit 75. The methods return at once (the driver polls), so the actor needs no threads: the launch is
started and watched from the actor's one thread, which PR_SET_PDEATHSIG ties it to.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _end_with_parent() -> None:  # in the child, before exec
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)


class Agent:
    """Ray actor class (ray.remote(...)(Agent) in the driver); plain Python, importable without Ray."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.hostfile: str | None = None

    def where(self) -> dict:
        """This node: its address as Ray knows it, its host name, a TCP port free on it now (for the master when
        this is node 0) and the GPUs Ray gave this actor (their ids on the node)."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return {"addr": ray.util.get_node_ip_address(), "host": socket.gethostname(), "port": port,
                "gpu_ids": [int(g) for g in ray.get_gpu_ids()], "node_id": ray.get_runtime_context().get_node_id()}

    def start(self, argv: list[str], hostfile: str, cwd: str) -> int:
        """`harness launch ...` (argv after `harness`, "{hostfile}" standing for the hostfile written here)
        started in its own session; its pid."""
        fd, path = tempfile.mkstemp(prefix="dsharness-ray-", suffix=".hostfile")
        with os.fdopen(fd, "w") as f:
            f.write(hostfile)
        self.hostfile = path
        argv = [path if a == "{hostfile}" else a for a in argv]
        child_env = dict(os.environ)
        child_env.pop("CUDA_VISIBLE_DEVICES", None)  # the launch names the GPUs with --include (Ray's ids)
        self.proc = subprocess.Popen([sys.executable, "-m", "harness.cli", *argv], cwd=cwd, env=child_env,
                                     start_new_session=True, preexec_fn=_end_with_parent)
        return self.proc.pid

    def poll(self) -> int | None:
        """The launch's exit code (the shell's 128 + N when a signal ended it), None while it runs."""
        code = self.proc.poll() if self.proc else None
        return None if code is None else 128 - code if code < 0 else code

    def signal(self, signum: int) -> None:
        """Forward a signal to the launch (it forwards it to every rank of this node)."""
        if self.proc and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signum)

    def stop(self) -> int:
        """Kill every process of the launch's tree (its own session and the ones it started); how many."""
        import psutil

        if self.hostfile:
            with contextlib.suppress(OSError):
                os.unlink(self.hostfile)
        if self.proc is None:
            return 0
        try:
            tree = [psutil.Process(self.proc.pid)]
            tree += tree[0].children(recursive=True)
        except psutil.NoSuchProcess:
            tree = []
        for proc in tree:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(tree, timeout=30)
        self.proc.wait()
        return len(tree)
