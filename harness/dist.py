"""Process group set-up and teardown. nccl on CUDA (one device per local rank), gloo/shm on CPU."""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass


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


def free_port() -> int:
    """A TCP port free on this host now (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _single_process_env() -> None:
    """`python harness/run.py` (no launcher): a world of one."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))


class CollectiveTimeout(RuntimeError):
    """A collective did not complete within train.collective_timeout: a peer hung or died."""

    def __init__(self, rank: int, minutes: float, cause: BaseException):
        super().__init__(f"rank {rank}: a collective did not complete within train.collective_timeout = {minutes:g} "
                         f"min; a peer rank hung or died ({str(cause).splitlines()[0][:200]})\n"
                         "    fix: look for the rank that failed first; raise train.collective_timeout if a step, "
                         "save or evaluation legitimately takes longer")


def is_timeout(e: BaseException) -> bool:
    """gloo raises 'Timed out waiting Nms for recv operation'; NCCL's watchdog (when it raises rather than aborts)
    and the store say 'Timeout(ms)=N' / 'wait timeout'."""
    text = str(e).lower()
    return isinstance(e, RuntimeError) and any(s in text for s in ("timed out waiting", "timeout(ms)", "wait timeout"))


def init(timeout_min: float = 30.0) -> DistInfo:
    """timeout_min bounds every collective (gloo and NCCL): a hung peer ends the job instead of waiting forever."""
    import datetime

    import deepspeed
    from deepspeed.accelerator import get_accelerator

    _single_process_env()
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
