"""The link between nodes, for `harness calibrate --link`: run on every node at once, one process per node.

    node 0:  harness calibrate --link --node-rank 0 --nnodes 2 --master-addr 10.0.0.1 --out link.json
    node 1:  harness calibrate --link --node-rank 1 --nnodes 2 --master-addr 10.0.0.1

The processes (one per node, so every byte crosses the wire) join one process group at MASTER_ADDR on the
backend training uses (NCCL on GPUs, gloo on the CPU accelerator; GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME pick
the interface as for a run) and time all_reduce, all_gather_into_tensor and reduce_scatter_tensor over all nodes
at several message sizes, as comm.py does inside a node, plus a point-to-point send/recv (ping-pong,
half the round trip): what a pipeline stage boundary pays. Node 0 writes the base profile (this node's
`harness calibrate`, or --base) with the inter-node figures replaced: inter_node_gbps (all_reduce bus bandwidth
at the largest message), inter_latency_us (per ring step, from the smallest) and measured.inter_node (the curves,
seconds per call against the buffer size), which planner/collectives.py prices every cross-node call on.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass

from harness.config.defaults import PRECISION_DTYPES
from harness.calibration.comm import COLLECTIVES, FACTOR, STEPS, op_curve

LINK_BYTES = 8 * 2**20  # the largest message: 8 MB takes 0.7 s over a 100 Mbit/s link, 6 ms over 10 Gbit/s


def link_sizes(nbytes: int) -> list[int]:
    """Buffer sizes of the curves: x4 apart from 32 KB up to `nbytes`. Finer than inside a node: a link's queue
    (a switch's buffer, a token bucket's burst) lets the first tens of KB of a message through at line rate, so
    the time per byte changes most between a few tens of KB and a few MB, where pipeline activations lie."""
    sizes, size = [], nbytes
    while size >= 32 * 2**10:
        sizes.append(size)
        size //= 4
    return sorted(sizes)


def _ping_pong(dist, nbytes: int, rank: int, repeat: int, dtype: str) -> float:
    """Seconds of one message from node 0 to node 1 (half a round trip)."""
    import torch

    buf = torch.ones(max(1, nbytes // torch.empty(0, dtype=getattr(torch, dtype)).element_size()),
                     dtype=getattr(torch, dtype))
    times = []
    for _ in range(repeat + 1):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        times.append((time.perf_counter() - start) / 2)
    return statistics.median(times[1:])


@dataclass(frozen=True)
class _Timing:
    """What measure times: messages up to nbytes (link_sizes), repeat calls each, in precision's dtype, giving up
    on the nodes' process group after timeout_min."""

    nbytes: int
    repeat: int
    precision: str
    timeout_min: float


def _worker(index: int, node_rank: int, nnodes: int, addr: str, port: int, out_path: str, timing: _Timing) -> None:
    import datetime

    os.environ.update({"RANK": str(node_rank), "LOCAL_RANK": "0", "WORLD_SIZE": str(nnodes),
                       "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": addr, "MASTER_PORT": str(port)})
    from harness.startup import quick_start

    quick_start()  # a fresh (spawned) process: start as a rank does, before DeepSpeed is imported
    import deepspeed
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator

    from harness.dist import exit_now

    accel = get_accelerator()
    device = "cpu" if accel.device_name() == "cpu" else accel.device_name(0)
    if device != "cpu":
        accel.set_device(0)
    deepspeed.init_distributed(dist_backend=accel.communication_backend_name(), verbose=False,
                               timeout=datetime.timedelta(minutes=timing.timeout_min))
    dtype, n, nbytes, repeat = PRECISION_DTYPES[timing.precision], nnodes, timing.nbytes, timing.repeat
    result = {"backend": accel.communication_backend_name(), "dtype": dtype, "nodes": n, "bus_gbps": {},
              "latency_us": {}, "seconds_by_bytes": {}}
    for op in COLLECTIVES:
        curve, small = op_curve(dist, op, link_sizes(nbytes), None, n, device, repeat, dtype)
        full = max(curve)
        result["bus_gbps"][op] = {str(n): full * FACTOR[op](n) / curve[full] / 1e9}
        result["latency_us"][op] = {str(n): small / STEPS[op](n) * 1e6}
        result["seconds_by_bytes"][op] = {str(n): {str(b): curve[b] for b in sorted(curve)}}
    if device == "cpu":  # point to point between the first two nodes (NCCL's send/recv would need streams synced)
        p2p = {str(size): _ping_pong(dist, size, node_rank, repeat, dtype) for size in link_sizes(nbytes)}
        result["seconds_by_bytes"]["send"] = {"2": p2p}
        largest = max(p2p, key=int)
        result["bus_gbps"]["send"] = {"2": int(largest) / p2p[largest] / 1e9}
    dist.barrier()
    if node_rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()
    exit_now(0)  # no interpreter finalization after gloo (see exit_now)


def measure(node_rank: int, nnodes: int, master_addr: str, master_port: int, *, nbytes: int = LINK_BYTES,
            repeat: int = 3, precision: str = "fp32", timeout_min: float = 5.0) -> dict:
    """The link's curves (node 0; {} on the other nodes), measured in a child process that joins the nodes'
    process group, so this process never holds one."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "link.json")
        timing = _Timing(nbytes, repeat, precision, timeout_min)
        mp.spawn(_worker, args=(node_rank, nnodes, master_addr, master_port, out, timing), nprocs=1, join=True)
        if node_rank != 0:
            return {}
        with open(out) as f:
            return json.load(f)


def merge(base: dict, link: dict, when: str) -> dict:
    """The base profile with the inter-node figures from the link."""
    n = str(link["nodes"])
    profile = dict(base)
    profile["inter_node_gbps"] = link["bus_gbps"]["all_reduce"][n]
    profile["inter_latency_us"] = statistics.median(by[n] for by in link["latency_us"].values())
    profile["measured"] = dict(base.get("measured") or {}, inter_node=link)
    profile["source"] = (base.get("source", "") + f"; inter-node link measured by `harness calibrate --link` over "
                         f"{n} nodes ({link['backend']}), {when}: all_reduce {profile['inter_node_gbps']:.4g} GB/s")
    return profile
