"""Collective bus bandwidth per group size on the real backend, for `harness calibrate`.

Starts `ranks` local processes (one per GPU on CUDA, NCCL; on the CPU accelerator the backend DeepSpeed picks
there, gloo), initialises deepspeed.comm as training does, and times all_reduce, all_gather_into_tensor and
reduce_scatter_tensor for each group size (2, 4, ... up to `ranks`, sub-groups of the first ranks). Bus
bandwidth follows nccl-tests (doc/PERFORMANCE.md): busbw = S / t x 2(n-1)/n for all-reduce and S / t x (n-1)/n
for the others, S the full buffer. A small message gives the latency per ring step.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import tempfile
import time

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
          "reduce_scatter": lambda n: (n - 1) / n}
STEPS = {"all_reduce": lambda n: 2 * (n - 1), "all_gather": lambda n: n - 1, "reduce_scatter": lambda n: n - 1}


def group_sizes(ranks: int) -> list[int]:
    sizes, n = [], 2
    while n <= ranks:
        sizes.append(n)
        n *= 2
    return sorted(set(sizes + ([ranks] if ranks > 1 else [])))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _time_op(dist, op: str, nbytes: int, group, n: int, device: str, repeat: int) -> tuple[float, int]:
    import torch

    numel = max(n, nbytes // 4 // n * n)
    full = torch.ones(numel, dtype=torch.float32, device=device)
    shard = torch.ones(numel // n, dtype=torch.float32, device=device)
    run = {"all_reduce": lambda: dist.all_reduce(full, group=group),
           "all_gather": lambda: dist.all_gather_into_tensor(full, shard, group=group),
           "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, full, group=group)}[op]
    run()
    times = []
    for _ in range(repeat):
        dist.barrier(group=group)
        start = time.perf_counter()
        run()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), numel * 4


def _worker(rank: int, ranks: int, port: int, out_path: str, nbytes: int, repeat: int) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(ranks),
                       "LOCAL_WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    import deepspeed
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    device = accel.device_name(rank) if accel.device_name() != "cpu" else "cpu"
    if device != "cpu":
        accel.set_device(rank)
    deepspeed.init_distributed(dist_backend=accel.communication_backend_name(), verbose=False)
    result = {"backend": accel.communication_backend_name(), "bus_gbps": {}, "latency_us": {}}
    for n in group_sizes(ranks):
        group = dist.new_group(list(range(n)))
        if rank >= n:
            continue
        for op in COLLECTIVES:
            t, full = _time_op(dist, op, nbytes, group, n, device, repeat)
            small, _ = _time_op(dist, op, 4096 * n, group, n, device, repeat)
            result["bus_gbps"].setdefault(op, {})[str(n)] = full * FACTOR[op](n) / t / 1e9
            result["latency_us"].setdefault(op, {})[str(n)] = small / STEPS[op](n) * 1e6
    dist.barrier()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def measure(ranks: int, nbytes: int | None = None, repeat: int = 5) -> dict:
    """{"backend", "bus_gbps": {op: {n: GB/s}}, "latency_us": {op: {n: us per step}}} over `ranks` processes."""
    import torch.multiprocessing as mp

    if ranks < 2:
        return {"error": "one rank: no collective to time (give --ranks 2 or more)"}
    if nbytes is None:  # big enough to be bandwidth bound: 256 MB on GPUs, 8 MB over gloo (~0.2 GB/s here)
        from deepspeed.accelerator import get_accelerator

        nbytes = 8 * 2**20 if get_accelerator().device_name() == "cpu" else 256 * 2**20
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "comm.json")
        mp.spawn(_worker, args=(ranks, _free_port(), out, nbytes, repeat), nprocs=ranks, join=True)
        with open(out) as f:
            return json.load(f)
