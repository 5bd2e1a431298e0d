"""A real one-node Slurm cluster for the tests (tests/test_slurm.py), as measured in docs/deepspeed-facts.md:
Debian's Slurm 22.05 (`apt-get install slurmd slurmctld slurm-client munge`), root, no systemd.

slurm.conf names this host (`hostname -s`) as the controller and the only node, with the CPUs and memory
`slurmd -C` reports; proctrack/linuxproc and task/none need no cgroups; every state, spool and log file lives
in a temporary folder, and the daemons listen on ports of their own, so nothing of the machine's own Slurm (if
any) is touched: clients find this cluster through SLURM_CONF. AuthInfo=cred_expire=10: a requeued job
otherwise waits 120 s for its old credential to expire. munged runs as the munge user with the key apt
created (/etc/munge/munge.key); one that already answers on /run/munge is used as it is.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

PACKAGES = "slurmd slurmctld slurm-client munge"
MUNGE_SOCKET = Path("/run/munge/munge.socket.2")
UP_TIMEOUT_S = 30


REQUIRE_ENV = "DSHARNESS_REQUIRE_SLURM"
CPUS = 6  # slots the node offers (slurmd accepts more than it has: config_overrides), so the tests' jobs overlap


def required() -> bool:
    """CI (.ci/run sets DSHARNESS_REQUIRE_SLURM=1; any CI sets CI) must run the Slurm tests: fail, never skip."""
    return os.environ.get(REQUIRE_ENV) == "1" or bool(os.environ.get("CI"))


def slurm_problem() -> str | None:
    """Why the cluster cannot be started here, or None. tests/test_slurm.py skips with it outside CI."""
    if os.geteuid() != 0:
        return "not root: slurmd and munged must start as root here"
    missing = [c for c in ("slurmctld", "slurmd", "sbatch", "munged", "setpriv") if shutil.which(c) is None]
    if missing:
        return f"{', '.join(missing)} not installed (apt-get install {PACKAGES}; .ci/run does)"
    if not Path("/etc/munge/munge.key").is_file():
        return "no /etc/munge/munge.key (apt-get install munge creates it)"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def node_line() -> str:
    """This host as a node: RealMemory as `slurmd -C` measures it, CPUS slots (the tests' ranks are CPU
    processes that do not need a core each; task/none binds nothing)."""
    out = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True).stdout
    memory = re.search(r"RealMemory=(\d+)", out).group(1)
    return f"NodeName={socket.gethostname().split('.')[0]} CPUs={CPUS} RealMemory={memory}"


def config(folder: Path) -> str:
    host = socket.gethostname().split(".")[0]
    lines = [
        "ClusterName=dsharness", f"SlurmctldHost={host}", f"SlurmctldPort={free_port()}", f"SlurmdPort={free_port()}",
        "SlurmUser=root", "AuthType=auth/munge", "AuthInfo=cred_expire=10", "CryptoType=crypto/munge",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core", "MpiDefault=none", "ReturnToService=2",
        # SIGTERM to SIGKILL on scancel (Slurm's default 30 s, the issue measured with 5): the ranks' save after
        # scancel took 0.4-2.5 s here; 15 leaves a margin on a loaded 2-core CI machine
        "KillWait=15",
        "SlurmdParameters=config_overrides", "SchedulerType=sched/builtin", "MinJobAge=600",
        # the main scheduler's pass every second, not 60: a requeued job starts once it is eligible (cred_expire
        # + 1 s after the requeue) rather than at the next pass, up to a minute later
        "SchedulerParameters=sched_interval=1",
        f"StateSaveLocation={folder / 'state'}", f"SlurmdSpoolDir={folder / 'spool'}",
        f"SlurmctldPidFile={folder / 'slurmctld.pid'}", f"SlurmdPidFile={folder / 'slurmd.pid'}",
        f"SlurmctldLogFile={folder / 'slurmctld.log'}", f"SlurmdLogFile={folder / 'slurmd.log'}",
        f"{node_line()} State=UNKNOWN",
        f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP",
    ]
    return "\n".join(lines) + "\n"


def start_munge() -> subprocess.Popen | None:
    """munged as the munge user (it refuses root), unless one answers already; the process to stop, or None."""
    if MUNGE_SOCKET.exists() and subprocess.run(["munge", "-n"], capture_output=True).returncode == 0:
        return None
    MUNGE_SOCKET.parent.mkdir(parents=True, exist_ok=True)
    shutil.chown(MUNGE_SOCKET.parent, "munge", "munge")
    os.chmod(MUNGE_SOCKET.parent, 0o755)
    proc = subprocess.Popen(["setpriv", "--reuid=munge", "--regid=munge", "--clear-groups", "munged", "--foreground",
                             "--force"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_until(lambda: subprocess.run(["munge", "-n"], capture_output=True).returncode == 0, "munged")
    return proc


def wait_until(ready, what: str, timeout_s: float = UP_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not come up in {timeout_s} s")
        time.sleep(0.2)


@dataclass
class Cluster:
    folder: Path
    env: dict  # os.environ plus SLURM_CONF: what sbatch, squeue, scontrol need to find this cluster
    procs: list

    def run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, check=check, timeout=60)

    def job(self, job_id: str) -> dict:
        """`scontrol show job` as {key: value} ({} once the controller has forgotten it)."""
        out = self.run("scontrol", "-o", "show", "job", job_id, check=False).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def log(self, name: str) -> str:
        path = self.folder / name
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def start(folder: Path) -> Cluster:
    """slurm.conf in `folder`, munged, slurmctld and slurmd in the foreground (-D) as children; up when sinfo
    shows the node idle."""
    for sub in ("state", "spool"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    conf = folder / "slurm.conf"
    conf.write_text(config(folder))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    procs = [p for p in [start_munge()] if p is not None]
    cluster = Cluster(folder, env, procs)
    try:
        for daemon in ("slurmctld", "slurmd"):
            with open(folder / f"{daemon}.out", "w") as out:
                procs.append(subprocess.Popen([daemon, "-D"], env=env, stdout=out, stderr=subprocess.STDOUT))
        wait_until(lambda: "idle" in cluster.run("sinfo", "-h", "-o", "%t", check=False).stdout, "the Slurm node")
    except BaseException:
        cluster.stop()
        raise
    return cluster
