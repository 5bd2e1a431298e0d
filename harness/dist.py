"""Process group set-up and teardown. nccl on CUDA (one device per local rank), gloo/shm on CPU."""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass

from harness.log import quiet_deprecated_all_gather


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: str  # "cuda:3", "cpu"
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


@dataclass(frozen=True)
class Launch:
    """What the launcher told this process before any process group exists: its rank, and how many ranks run in
    all and on this node. Read once by the entry point (harness/run.py, `launched`) and passed on; `harness doctor`
    makes one for the world it checks instead of faking the environment."""

    world_size: int
    local_size: int  # ranks on this node
    rank: int = 0
    local_rank: int = 0


@dataclass(frozen=True)
class SlurmStep:
    """The Slurm job step this process is a task of (srun set SLURM_STEP_*): how many tasks on how many nodes,
    and which one this is. In a batch script outside srun there is no step (SLURM_JOB_ID alone)."""

    job_id: str
    num_nodes: int
    num_tasks: int
    node_id: int  # this task's node within the step, 0-based
    proc_id: int  # this task's rank within the step
    local_id: int  # this task's rank on its node
    nodelist: str  # Slurm's compressed form (node[01-04]); `scontrol show hostnames` expands it
    restarts: int  # SLURM_RESTART_COUNT: 0 on the first run, then one more per requeue


def slurm_job_id() -> str | None:
    """SLURM_JOB_ID: inside a Slurm allocation (a batch script, srun, salloc), else None."""
    return os.environ.get("SLURM_JOB_ID")


def slurm_step() -> SlurmStep | None:
    if "SLURM_STEP_NUM_TASKS" not in os.environ:
        return None
    env = os.environ
    return SlurmStep(env.get("SLURM_JOB_ID", "?"), int(env.get("SLURM_STEP_NUM_NODES", "1")),
                     int(env["SLURM_STEP_NUM_TASKS"]), int(env.get("SLURM_NODEID", "0")),
                     int(env.get("SLURM_PROCID", "0")), int(env.get("SLURM_LOCALID", "0")),
                     env.get("SLURM_STEP_NODELIST", env.get("SLURM_JOB_NODELIST", "")),
                     int(env.get("SLURM_RESTART_COUNT", "0")))


def launched() -> Launch | None:
    """The launcher's contract: WORLD_SIZE, RANK, LOCAL_RANK, and the ranks on this node (DeepSpeed's launch.py
    sets LOCAL_SIZE, torchrun LOCAL_WORLD_SIZE; neither: one node). None when no launcher set WORLD_SIZE.
    Without them, the tasks of a Slurm step of more than one task (`srun --ntasks=8 python harness/run.py`) are
    the ranks: SLURM_PROCID of SLURM_STEP_NUM_TASKS (every task would otherwise be rank 0 of 1, TRL#2605).
    DeepSpeed's variables win: under `harness launch` in an srun task, the task is a node's launcher, not a rank."""
    if "WORLD_SIZE" not in os.environ:
        step = slurm_step()
        if step is None or step.num_tasks == 1:
            return None
        per_node = -(-step.num_tasks // step.num_nodes)  # srun's default block distribution
        return Launch(step.num_tasks, per_node, step.proc_id, step.local_id)
    world = int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or world)
    return Launch(world, local, int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0")))


def slurm_hostnames(nodelist: str) -> list[str]:
    """Slurm's compressed node list (node[01-04],gpu7) expanded by Slurm itself (`scontrol show hostnames`)."""
    import subprocess

    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
    return out.stdout.split()


def slurm_port(job_id: str, restarts: int = 0) -> int:
    """A port every task of a job computes alike (no rendezvous needed to agree on it), 20000-39999; another one
    after each requeue, so a rerun never meets its predecessor's socket in TIME_WAIT. The batch script of
    `harness slurm` computes the same in bash."""
    return 20000 + (int(job_id) + 997 * restarts) % 20000 if job_id.isdigit() else 29500


ONE_PROCESS = Launch(world_size=1, local_size=1)  # `python harness/run.py`: no launcher


def free_port() -> int:
    """A TCP port free on this host now (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _single_process_env() -> None:
    """`python harness/run.py` (no launcher): a world of one; tasks of a Slurm step: the world `launched` reads
    from Slurm, meeting on the step's first node (MASTER_ADDR/MASTER_PORT, if set, win)."""
    if "RANK" in os.environ:
        return
    launch, step = launched(), slurm_step()
    if launch is None or step is None:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
        return
    os.environ.update(RANK=str(launch.rank), LOCAL_RANK=str(launch.local_rank), WORLD_SIZE=str(launch.world_size),
                      LOCAL_SIZE=str(launch.local_size))
    os.environ.setdefault("MASTER_ADDR", slurm_hostnames(step.nodelist)[0])
    os.environ.setdefault("MASTER_PORT", str(slurm_port(step.job_id, step.restarts)))


class CollectiveTimeout(RuntimeError):
    """A collective did not complete within train.collective_timeout: a peer hung or died, or the link to it."""

    def __init__(self, rank: int, minutes: float, cause: BaseException, peers: str = "a peer rank hung or died"):
        super().__init__(f"rank {rank}: a collective did not complete within train.collective_timeout = {minutes:g} "
                         f"min; {peers} ({str(cause).splitlines()[0][:200]})\n"
                         "    fix: look for the rank that failed first; raise train.collective_timeout if a step, "
                         "save or evaluation legitimately takes longer")


_HOSTS: list[str] = []  # each rank's address, as its peers reach it (init)


def host_address() -> str:
    """This rank's address on the way to MASTER_ADDR (the interface its collectives use): a UDP socket's
    connect() only picks the route, nothing is sent."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))))
            return s.getsockname()[0]
        except OSError:
            return socket.gethostname()


def silent_peers(rank: int, timeout_min: float) -> str:
    """After a timeout: which peer is gone, asked through the process group's store on rank 0's host. Every rank
    that timed out checks in; a rank that cannot reach the store names rank 0's host (the link to it, or it, is
    down), the others name the ranks that did not check in within a short wait (1-5 s: ranks stuck in the same
    collective time out within moments of each other)."""
    import threading
    import time

    from torch.distributed import distributed_c10d as c10d

    wait_s = min(5.0, max(1.0, 0.1 * timeout_min * 60))
    hosts = _HOSTS or ["?"]

    def where(r: int) -> str:
        return f"rank {r} ({hosts[r] if r < len(hosts) else '?'})"

    try:
        store = c10d._get_default_store()
    except (RuntimeError, ValueError):
        return "a peer rank hung or died"
    reached = []
    probe = threading.Thread(target=lambda: reached.append(store.add(f"harness/timed_out/{rank}", 1)), daemon=True)
    probe.start()
    probe.join(wait_s)  # over a dead link the store's own timeout would be the collective's: do not wait for it
    if not reached:
        return f"cannot reach {where(0)}, the store's host: the link to that peer is down, or it died"
    world = len(_HOSTS) if _HOSTS else 0
    missing = [r for r in range(world) if r != rank]
    deadline = time.monotonic() + wait_s
    while missing and time.monotonic() < deadline:
        time.sleep(0.2)
        missing = [r for r in missing if not store.check([f"harness/timed_out/{r}"])]
    if not missing:
        return "every rank checked in after it: a peer rank hung or died, or the ranks disagree on the collective"
    named = ", ".join(where(r) for r in missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
    return f"no answer from peer {named}: the link to it is down, or it hung or died"


TIMEOUT_TEXTS = ("timed out waiting", "timeout(ms)", "wait timeout", "application timeout caused pair closure")


def is_timeout(e: BaseException) -> bool:
    """gloo raises 'Timed out waiting Nms for recv operation' in the op that timed out, and 'Application timeout
    caused pair closure' in an async op still pending on that pair (a ZeRO-3 prefetch's all-gather handle, waited
    on in the next module's forward: measured in tests/test_two_hosts.py's link-down case); NCCL's watchdog (when it
    raises rather than aborts) and the store say 'Timeout(ms)=N' / 'wait timeout'."""
    text = str(e).lower()
    return isinstance(e, RuntimeError) and any(s in text for s in TIMEOUT_TEXTS)


def init(timeout_min: float = 30.0) -> DistInfo:
    """timeout_min bounds every collective (gloo and NCCL): a hung peer ends the job instead of waiting forever."""
    import datetime

    import deepspeed
    from deepspeed.accelerator import get_accelerator

    _single_process_env()
    quiet_deprecated_all_gather()
    accel = get_accelerator()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if accel.device_name() != "cpu":
        accel.set_device(local_rank)  # before the process group, so nccl binds the right GPU
    deepspeed.init_distributed(dist_backend=accel.communication_backend_name(),
                               timeout=datetime.timedelta(minutes=timeout_min))
    device = accel.device_name(local_rank) if accel.device_name() != "cpu" else "cpu"
    import torch.distributed as dist

    if accel.device_name() == "cpu" and dist.get_world_size() > 1:
        unlink_shm_buffer(dist)
    if dist.get_world_size() > 1:  # to name a peer that goes silent (silent_peers)
        _HOSTS[:] = [None] * dist.get_world_size()
        dist.all_gather_object(_HOSTS, host_address())

    return DistInfo(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank,
                    device=device, backend=dist.get_backend())


def unlink_shm_buffer(dist) -> None:
    """DeepSpeed's CPU shm all-reduce never unlinks its /dev/shm buffer (~66 MB per rank per run, leaked for
    good). Once every rank has mapped its peers' buffers (after a barrier) the name can go; the memory is
    then freed when the processes exit, even after a crash."""
    from pathlib import Path

    dist.barrier()
    name = (f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{dist.get_rank()}")
    Path("/dev/shm", name).unlink(missing_ok=True)


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def broadcast_object(obj, src: int = 0):
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def gather_all(obj) -> list:
    """Every rank's obj, in rank order, on every rank ([obj] without a process group)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def mean_across_ranks(values) -> list[float]:
    """Average scalars (floats, or 0-d tensors on any device) over all ranks in one all-reduce; tensor-parallel
    duplicates average to the same value."""
    import torch
    import torch.distributed as dist

    nccl = dist.is_initialized() and dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    t = torch.stack([torch.as_tensor(v, dtype=torch.float64).detach().to(device) for v in values])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return t.cpu().tolist()


def teardown() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def exit_now(code: int) -> None:
    """End the process without interpreter finalization. With gloo, a worker thread of torch's process group can
    drop the last reference to a Python-owned tensor while the interpreter finalizes; taking the GIL then ends
    that thread by forced unwind and std::terminate aborts a rank whose run has finished and saved everything
    (seen intermittently under load: "terminate called without an active exception", exit -6). Everything the
    run writes is closed by now; flush the standard streams and logging, then _exit."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
