"""Two hosts on one machine: two network namespaces joined by a veth pair, each with its own address.

    with TwoHosts() as hosts:                      # root only; hosts.unavailable() says why not
        hosts.popen(0, [...], env=..., stdout=...)  # a process on host 0 (10.231.N.1), another on host 1 (.2)
        hosts.link(False); hosts.link(True)         # take the wire down / bring it back
        hosts.slow("100mbit")                       # tbf on both ends of the wire

Each host sees only its own loopback and its end of the wire, so everything between the two crosses a real
network interface (veth: the kernel's TCP stack, queueing disciplines, link state). The file system is shared, as
two nodes with shared storage would have it. Traffic goes only to loopback and to these two addresses, in
10.231.N.0/24 (N from the pid); the namespaces (and with them the veth pair) are deleted on exit, also after a
failure.

Slowing the wire: `tc netem` needs the sch_netem kernel module, which not every kernel has (this machine's does not:
"Specified qdisc kind is unknown"), so the wire is slowed with a token bucket (`tbf rate R burst B latency L`),
which every kernel has: it caps the rate at R; a packet waits in the bucket's queue at most L before it is dropped.
That gives a slow link (rate), not a long one (no added propagation delay).
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from helpers.launch import DEEPSPEED, ROOT, env, free_port

IP = "/usr/sbin/ip" if os.path.exists("/usr/sbin/ip") else "ip"
TC = "/usr/sbin/tc" if os.path.exists("/usr/sbin/tc") else "tc"
SCRIPT = ROOT / "docker" / "launch_multinode.sh"
HARNESS = DEEPSPEED.parent / "harness"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([IP, *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc


@functools.lru_cache(maxsize=1)
def unavailable() -> str | None:
    """Why two hosts cannot be made here (None when they can): network namespaces need root (CAP_SYS_ADMIN)."""
    if os.geteuid() != 0:
        return "network namespaces need root (`ip netns add`); CI runs as root"
    probe = f"dshprobe{os.getpid()}"
    try:
        proc = _ip("netns", "add", probe, check=False)
    except FileNotFoundError:
        return "no `ip` command (iproute2)"
    if proc.returncode != 0:
        return f"`ip netns add` is not permitted here: {proc.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class TwoHosts:
    """Host 0 and host 1: namespaces `ns[i]`, interfaces `ifname[i]`, addresses `addr[i]`."""

    def __init__(self):
        tag = uuid.uuid4().hex[:6]
        self.ns = [f"dsh{tag}h0", f"dsh{tag}h1"]
        self.ifname = [f"dsh{tag}i0", f"dsh{tag}i1"]  # at most 15 characters
        subnet = 1 + os.getpid() % 250
        self.addr = [f"10.231.{subnet}.1", f"10.231.{subnet}.2"]

    def __enter__(self) -> TwoHosts:
        try:
            for ns in self.ns:
                _ip("netns", "add", ns)
                _ip("-n", ns, "link", "set", "lo", "up")
            _ip("link", "add", self.ifname[0], "type", "veth", "peer", "name", self.ifname[1])
            for i in (0, 1):
                _ip("link", "set", self.ifname[i], "netns", self.ns[i])
                _ip("-n", self.ns[i], "addr", "add", f"{self.addr[i]}/24", "dev", self.ifname[i])
                _ip("-n", self.ns[i], "link", "set", self.ifname[i], "up")
            self.check_wire()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for ns in self.ns:  # deleting a namespace deletes its end of the veth pair, and with it the other end
            _ip("netns", "del", ns, check=False)
        _ip("link", "del", self.ifname[0], check=False)  # only if it never reached its namespace

    def command(self, host: int, argv: list[str]) -> list[str]:
        return [IP, "netns", "exec", self.ns[host], *argv]

    def popen(self, host: int, argv: list[str], **kwargs) -> subprocess.Popen:
        """A process on `host` (the environment passes through `ip netns exec`)."""
        return subprocess.Popen(self.command(host, argv), **kwargs)

    def env(self, host: int) -> dict:
        """What a rank on `host` needs besides the usual: gloo on this host's end of the wire."""
        return {"GLOO_SOCKET_IFNAME": self.ifname[host]}

    def link(self, up: bool) -> None:
        """Take the wire down (both ends: no carrier, packets dropped, no reset sent) or bring it back."""
        for i in (0, 1):
            _ip("-n", self.ns[i], "link", "set", self.ifname[i], "up" if up else "down")

    def slow(self, rate: str, burst: str = "64kb", latency: str = "400ms") -> None:
        """Cap each direction of the wire at `rate` (a tbf on each end's egress; see the module docstring)."""
        for i in (0, 1):
            proc = subprocess.run([IP, "netns", "exec", self.ns[i], TC, "qdisc", "replace", "dev", self.ifname[i],
                                   "root", "tbf", "rate", rate, "burst", burst, "latency", latency],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"tc tbf on {self.ifname[i]}: {proc.stderr.strip()}")

    def unslow(self) -> None:
        for i in (0, 1):
            subprocess.run([IP, "netns", "exec", self.ns[i], TC, "qdisc", "del", "dev", self.ifname[i], "root"],
                           capture_output=True)

    def check_wire(self, timeout_s: float = 5.0) -> None:
        """A TCP connection from host 1 to host 0 across the wire (there is no ping here)."""
        code = (f"import socket,sys; s=socket.socket(); s.bind(({self.addr[0]!r}, 0)); s.listen(1); "
                "print(s.getsockname()[1], flush=True); c, _ = s.accept(); c.sendall(b'ok'); c.close()")
        server = self.popen(0, [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        try:
            port = int(server.stdout.readline())
            client = (f"import socket; c=socket.create_connection(({self.addr[0]!r}, {port}), timeout={timeout_s}); "
                      "assert c.recv(2) == b'ok'")
            proc = subprocess.run(self.command(1, [sys.executable, "-c", client]), capture_output=True, text=True,
                                  timeout=timeout_s + 30)
            if proc.returncode != 0:
                raise RuntimeError(f"no TCP from {self.addr[1]} to {self.addr[0]}: {proc.stderr.strip()[-500:]}")
        finally:
            server.kill()
            server.wait()


def start_nodes(hosts: TwoHosts, tmp: Path, args: list[str], tag: str) -> tuple[list, list[Path]]:
    """Each host's node of one run, as docker/launch_multinode.sh starts real ones (`harness launch --no_ssh
    --node_rank N`, one rank per node, MASTER_ADDR host 0's address on the wire); output to files."""
    hostfile = tmp / "hostfile"
    hostfile.write_text("hostA slots=1\nhostB slots=1\n")
    port = free_port()
    procs, logs = [], []
    for node in (0, 1):
        log = tmp / f"{tag}-node{node}.log"
        node_env = dict(env(), **hosts.env(node), NODE_RANK=str(node), MASTER_ADDR=hosts.addr[0],
                        MASTER_PORT=str(port), HOSTFILE=str(hostfile), DEEPSPEED=f"{HARNESS} launch")
        with open(log, "w") as out:
            procs.append(hosts.popen(node, [str(SCRIPT), *args], cwd=ROOT, env=node_env, stdout=out,
                                     stderr=subprocess.STDOUT, start_new_session=True))
        logs.append(log)
    return procs, logs


def stop(procs) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def wait_nodes(procs, timeout_s: float = 300) -> list[int]:
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        stop(procs)
    return [p.returncode for p in procs]


def tails(logs) -> str:
    return "".join(f"\n--- {log.name}\n{log.read_text()[-4000:]}" for log in logs)


def calibrate_link(hosts: TwoHosts, base: Path, out: Path, timeout_s: float = 300) -> str:
    """`harness calibrate --link` on both hosts at once; node 0 writes `out` (base + the wire's figures).
    Returns node 0's output."""
    port = free_port()
    procs = [hosts.popen(node, [str(HARNESS), "calibrate", "--link", "--node-rank", str(node), "--nnodes", "2",
                                "--master-addr", hosts.addr[0], "--master-port", str(port), "--base", str(base),
                                "--out", str(out)],
                         cwd=ROOT, env=dict(env(), **hosts.env(node)), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for node in (0, 1)]
    try:
        outputs = [p.communicate(timeout=timeout_s)[0] for p in procs]
    finally:
        stop(procs)
    if [p.returncode for p in procs] != [0, 0]:
        raise RuntimeError(f"calibrate --link exited {[p.returncode for p in procs]}:\n" + "\n".join(outputs))
    return outputs[0]
