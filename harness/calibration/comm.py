"""Collective bus bandwidth per group size on the real backend, for `harness calibrate`.

Starts `ranks` local processes (one per GPU on CUDA, NCCL; on the CPU accelerator the backend DeepSpeed picks
there, gloo), initialises deepspeed.comm as training does, and times all_reduce, all_gather_into_tensor,
reduce_scatter_tensor and all_to_all_single (S: one rank's input, as the comms logger logs it) for each group
size (2, 4, ... up to `ranks`, sub-groups of the first ranks), in the training dtype, at several message sizes:
training sends messages of very different sizes (a ZeRO-1/2 bucket of hidden^2 elements, one module's ZeRO-3
gather, a tensor-parallel activation, the whole gradient at once under ZeRO-0), and bandwidth is far from flat
in the size, over gloo most of all (measured here: a 0.7 MB all-reduce runs at a third of a 48 MB one's bus
bandwidth). `seconds_by_bytes` keeps the curve, t per call
against the full buffer S; planner/collectives.py reads its time per call from it. Bus bandwidth follows
nccl-tests (doc/PERFORMANCE.md): busbw = S / t x 2(n-1)/n for all-reduce and S / t x (n-1)/n for the others;
`bus_gbps` is the largest message's. A small message gives the latency per ring step.

After the collectives, when given the model, each rank also times a real DeepSpeed engine step
(engine.py): all ranks at once, as training runs them.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time

from harness.config.defaults import PRECISION_DTYPES

# all_to_all_single: expert parallelism's dispatch and combine (DeepSpeed AutoEP). Its own curve, not all_reduce's:
# on the CPU accelerator DeepSpeed all-reduces through its shared-memory op while the all-to-all goes over gloo.
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all_single")
FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
          "reduce_scatter": lambda n: (n - 1) / n, "all_to_all_single": lambda n: (n - 1) / n}
STEPS = {"all_reduce": lambda n: 2 * (n - 1), "all_gather": lambda n: n - 1, "reduce_scatter": lambda n: n - 1,
         "all_to_all_single": lambda n: n - 1}


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




def message_sizes(nbytes: int) -> list[int]:
    """Full-buffer sizes of the curve: from 1/256 of the largest up, x8 apart (64 KB .. 32 MB over gloo)."""
    sizes, size = [], nbytes
    while size >= nbytes // 256 and len(sizes) < 4:
        sizes.append(size)
        size //= 8
    return sorted(sizes)


def op_curve(dist, op: str, sizes, group, n: int, device, repeat: int, dtype) -> tuple[dict, float]:
    """Seconds per call of `op` at each message size (keyed by the full message's bytes), a 4 KB-per-rank call
    included; and that small call's seconds, the latency term."""
    curve = {}
    for size in sizes:
        t, full = _time_op(dist, op, size, group, n, device, repeat, dtype)
        curve[full] = t
    small, small_full = _time_op(dist, op, 4096 * n, group, n, device, repeat, dtype)
    curve[small_full] = small
    return curve, small


def _time_op(dist, op: str, nbytes: int, group, n: int, device: str, repeat: int,
             dtype: str = "float32") -> tuple[float, int]:
    import torch

    dt = getattr(torch, dtype)
    itemsize = torch.empty(0, dtype=dt).element_size()
    numel = max(n, nbytes // itemsize // n * n)
    full = torch.ones(numel, dtype=dt, device=device)
    shard = torch.ones(numel // n, dtype=dt, device=device)
    run = {"all_reduce": lambda: dist.all_reduce(full, group=group),
           "all_gather": lambda: dist.all_gather_into_tensor(full, shard, group=group),
           "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, full, group=group),
           "all_to_all_single": lambda: dist.all_to_all_single(torch.empty_like(full), full, group=group)}[op]
    run()
    times = []
    for _ in range(repeat):
        dist.barrier(group=group)
        start = time.perf_counter()
        run()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    # the fastest repeat: other work on a shared machine only adds time, and the engine steps these prices are
    # subtracted from are taken the same way (hooks.py)
    return min(times), numel * itemsize


def _worker(rank: int, ranks: int, port: int, out_path: str, nbytes: int, repeat: int, precision: str = "fp32",
            engine_args: dict | None = None) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(ranks),
                       "LOCAL_WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    from harness.startup import quick_start

    quick_start()  # a fresh (spawned) process: start as a rank does, before DeepSpeed is imported
    import deepspeed
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    device = accel.device_name(rank) if accel.device_name() != "cpu" else "cpu"
    if device != "cpu":
        accel.set_device(rank)
    deepspeed.init_distributed(dist_backend=accel.communication_backend_name(), verbose=False)
    dtype = PRECISION_DTYPES[precision]
    result = {"backend": accel.communication_backend_name(), "dtype": dtype, "bus_gbps": {}, "latency_us": {},
              "seconds_by_bytes": {}}
    for n in group_sizes(ranks):
        group = dist.new_group(list(range(n)))
        if rank >= n:
            continue
        for op in COLLECTIVES:
            curve, small = op_curve(dist, op, message_sizes(nbytes), group, n, device, repeat, dtype)
            full = max(curve)
            result["bus_gbps"].setdefault(op, {})[str(n)] = full * FACTOR[op](n) / curve[full] / 1e9
            result["latency_us"].setdefault(op, {})[str(n)] = small / STEPS[op](n) * 1e6
            result["seconds_by_bytes"].setdefault(op, {})[str(n)] = {str(b): curve[b] for b in sorted(curve)}
    dist.barrier()
    if engine_args:
        from harness.calibration.engine import measure as measure_engine

        result["engine"] = measure_engine(**engine_args)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()
    from harness.dist import exit_now

    exit_now(0)  # no interpreter finalization after gloo (it can abort a finished rank, see exit_now)


def measure(ranks: int, nbytes: int | None = None, repeat: int = 5, precision: str = "fp32",
            engine_args: dict | None = None) -> dict:
    """{"backend", "bus_gbps": {op: {n: GB/s}}, "latency_us": {op: {n: us per step}}, "seconds_by_bytes":
    {op: {n: {bytes: s}}}} over `ranks` processes; with engine_args also "engine" (engine.measure)."""
    import torch.multiprocessing as mp

    if ranks < 2:
        return {"error": "one rank: no collective to time (give --ranks 2 or more)"}
    if nbytes is None:  # the largest message: 256 MB on GPUs, 32 MB over gloo (~0.7 GB/s here)
        from deepspeed.accelerator import get_accelerator

        nbytes = 32 * 2**20 if get_accelerator().device_name() == "cpu" else 256 * 2**20
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "comm.json")
        mp.spawn(_worker, args=(ranks, _free_port(), out, nbytes, repeat, precision, engine_args), nprocs=ranks,
                 join=True)
        with open(out) as f:
            return json.load(f)
