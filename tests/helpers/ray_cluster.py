"""A real two-node Ray cluster on one machine (tests/test_ray.py, bench/ray_start.py): a head node on host 0 and a
worker node on host 1 of tests/helpers/twohosts.py's network namespaces.

Every Ray process runs inside the namespaces with its address given (`--node-ip-address`): at start-up Ray tries
to learn its own address by connecting towards a public DNS address, and inside the namespaces there is no route
out, so nothing leaves the machine. Usage statistics off (flag and RAY_USAGE_STATS_ENABLED=0), the object store
capped at 100 MB, one CPU per node (one agent each), no dashboard. Each node's session folder is its own short
path under /tmp (Ray's Unix sockets allow ~100 characters). Health checks every second, a node dead after 3
missed ones: Ray's defaults (5 s x 5) would take ~30 s to see a killed node.

Cleaning up never uses `ray stop` (it ends Ray processes machine-wide by name): each node's processes are the
processes inside its namespace (`ip netns pids`), killed by id.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from helpers.launch import ROOT, env
from helpers.twohosts import IP, TwoHosts

RAY = Path(sys.executable).parent / "ray"
REQUIRE_ENV = "DSHARNESS_REQUIRE_RAY"
NODE_FLAGS = ["--num-cpus=1", "--object-store-memory=100000000", "--disable-usage-stats"]
HEAD_FLAGS = ["--include-dashboard=false"]  # a worker node refuses it
FAST_HEALTH = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3",
               "RAY_health_check_initial_delay_ms": "1000"}


def ray_problem() -> str | None:
    """Why no Ray cluster can start here (None when it can)."""
    try:
        import ray  # noqa: F401
    except ImportError:
        return "ray is not installed (pip install -e '.[ray]'; .ci/run does)"
    return None


def required() -> bool:
    """CI (.ci/run sets DSHARNESS_REQUIRE_RAY=1) must run the Ray test: fail, never skip."""
    return os.environ.get(REQUIRE_ENV) == "1"


def node_env(hosts: TwoHosts, host: int) -> dict:
    """What each node's Ray processes (and so the agents, launchers and ranks they start) run with."""
    return {**env(), **hosts.env(host), **FAST_HEALTH, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(ROOT)}


class RayCluster:
    """Head on host 0 (address `self.address`), workers on host 1 started and killed at will."""

    def __init__(self, hosts: TwoHosts, log_dir: Path):
        self.hosts, self.log_dir = hosts, log_dir
        self.port = 6379 + os.getpid() % 1000
        self.address = f"{hosts.addr[0]}:{self.port}"
        self.temp = Path(tempfile.mkdtemp(prefix="dshray"))
        self.workers = 0

    def start_head(self) -> float:
        """Seconds until `ray start --head` returned (the head is up)."""
        return self._start(0, ["--head", f"--port={self.port}", *HEAD_FLAGS], "head")

    def start_worker(self) -> float:
        """A worker node on host 1 joined to the head (a replacement after kill_node(1)): seconds to start."""
        self.workers += 1
        return self._start(1, [f"--address={self.address}"], f"worker{self.workers}")

    def _start(self, host: int, args: list[str], name: str) -> float:
        temp = self.temp / name
        temp.mkdir()
        began = time.monotonic()
        with open(self.log_dir / f"ray-{name}.log", "w") as out:
            proc = subprocess.run(self.hosts.command(host, [str(RAY), "start", *args, *NODE_FLAGS,
                                                            f"--node-ip-address={self.hosts.addr[host]}",
                                                            f"--temp-dir={temp}"]),
                                  cwd=ROOT, env=node_env(self.hosts, host), stdout=out, stderr=subprocess.STDOUT,
                                  timeout=180)
        if proc.returncode != 0:
            raise RuntimeError(f"ray start on host {host} exited {proc.returncode}:\n"
                               f"{(self.log_dir / f'ray-{name}.log').read_text()[-3000:]}")
        return time.monotonic() - began

    def pids(self, host: int) -> list[int]:
        out = subprocess.run([IP, "netns", "pids", self.hosts.ns[host]], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def kill_node(self, host: int) -> int:
        """SIGKILL every process of the host (raylet, workers, agent, launcher, ranks): a node lost. How many."""
        pids = self.pids(host)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 30
        while self.pids(host) and time.monotonic() < deadline:
            time.sleep(0.1)
        return len(pids)

    def popen(self, host: int, argv: list[str], **kwargs) -> subprocess.Popen:
        """A process on `host` with the node's environment (e.g. the `harness ray` driver on the head's host)."""
        return self.hosts.popen(host, argv, cwd=ROOT, env=node_env(self.hosts, host), **kwargs)

    def stop(self) -> None:
        """Every process of both hosts killed, the session folders removed (the namespaces go with TwoHosts)."""
        for host in (1, 0):
            self.kill_node(host)
        shutil.rmtree(self.temp, ignore_errors=True)
