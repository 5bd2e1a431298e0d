"""Time of one collective from its size, group size and placement: the alpha-beta model NCCL's tuner uses.

Bandwidth term (ring algorithms; Thakur, Rabenseifner & Gropp 2005; NCCL's "bus bandwidth" convention,
nccl-tests doc/PERFORMANCE.md): with S the full buffer, n ranks and B the bus bandwidth,
    all_reduce       t = 2 (n-1)/n * S / B          (reduce-scatter then all-gather)
    reduce_scatter   t =   (n-1)/n * S / B          (S: the full input)
    all_gather       t =   (n-1)/n * S / B          (S: the gathered output = n x the shard DeepSpeed logs)
    send / recv      t =             S / B          (one link; B the link's per-direction bandwidth)
    all_to_all       t =   (n-1)/n * S / B          (S: this rank's input; n-1 pairwise exchanges)
Latency term: alpha per step; a ring takes 2(n-1) steps for an all-reduce and n-1 for the others, a tree
2 log2(n) (NCCL switches to trees when that is shorter, so the smaller of the two is used for all-reduce).

Placement: a group whose ranks sit in one node (stride x size <= GPUs per node; ranks are laid out tensor
fastest, then data, then pipeline, as DeepSpeed's PipeModelDataParallelTopology does) runs at the
intra-node bus bandwidth (NVLink/NVSwitch, or PCIe); any group spanning nodes is limited by each GPU's
share of the node's NICs (inter_node_gbps): NCCL builds one ring per NIC, so every GPU of the ring sends
at most its NIC's rate. `harness calibrate` measures B per collective and group size on the real backend;
those measurements replace the profile's single figure when present (measured.bus_gbps).

Message size: a calibrated profile also holds the time of one call against its size (measured.seconds_by_bytes,
a curve from a few KB to tens of MB). Inside a node the time per call is read off that curve, interpolated
log-log between the measured sizes, beyond the largest at its bandwidth, below the smallest at its latency:
what bucketed traffic (ZeRO's hidden^2 buckets, per-module gathers, per-block TP all-reduces) really costs
over a backend whose bandwidth is far from flat in the size (gloo). Without a curve: the alpha-beta above.
Across nodes the same, on the curves `harness calibrate --link` measured between the nodes
(measured.inter_node.seconds_by_bytes, send/recv included); a profile without them prices cross-node calls
with the alpha-beta model on inter_node_gbps and inter_latency_us.
"""

from __future__ import annotations

import math

from harness.planner import hardware

RING_STEPS = {"all_reduce": lambda n: 2 * (n - 1), "reduce_scatter_tensor": lambda n: n - 1,
              "all_gather_into_tensor": lambda n: n - 1, "send": lambda n: 1, "recv": lambda n: 1,
              "all_to_all_single": lambda n: n - 1}
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter_tensor": lambda n: (n - 1) / n,
              "all_gather_into_tensor": lambda n: (n - 1) / n, "send": lambda n: 1.0, "recv": lambda n: 1.0,
              "all_to_all_single": lambda n: (n - 1) / n}


def spans_nodes(stride: int, size: int, gpus_per_node: int) -> bool:
    return stride * size > gpus_per_node


def bus_gbps(profile: dict, collective: str, size: int, inter: bool) -> float:
    """Bus bandwidth for this collective: a calibrated figure for the nearest measured group size inside a
    node when there is one, else the profile's intra/inter-node figure."""
    measured = hardware.measured(profile, "bus_gbps").get(_op_key(collective))
    if measured and not inter:
        sizes = sorted(int(k) for k in measured)
        nearest = min(sizes, key=lambda k: (abs(k - size), -k))
        return measured[str(nearest)]
    return profile["inter_node_gbps" if inter else "intra_node_gbps"]


def _op_key(collective: str) -> str:
    return collective.removesuffix("_tensor").removesuffix("_into")


def curve_s(profile: dict, collective: str, size: int, full: float, inter: bool = False) -> float | None:
    """Seconds of one call of `full` bytes from the calibrated curve of the nearest group size (inside a node, or
    across nodes when `inter`); None without."""
    curves = (hardware.measured(profile, "inter_node").get("seconds_by_bytes", {}) if inter
              else hardware.measured(profile, "seconds_by_bytes"))
    by_size = curves.get("send" if collective in ("send", "recv") else _op_key(collective))
    if not by_size:
        return None
    nearest = min((int(k) for k in by_size), key=lambda k: (abs(k - size), -k))
    points = sorted((int(b), t) for b, t in by_size[str(nearest)].items())
    if full <= points[0][0]:
        return points[0][1]
    if full >= points[-1][0]:
        return points[-1][1] * full / points[-1][0]
    for (b0, t0), (b1, t1) in zip(points, points[1:]):
        if b0 <= full <= b1:
            w = math.log(full / b0) / math.log(b1 / b0)
            return math.exp(math.log(t0) + w * (math.log(t1) - math.log(t0)))
    return None


def full_bytes(collective: str, logged_bytes: float, size: int) -> float:
    """The buffer S of the formulas from the comms-logger size (all-gather logs the input shard)."""
    return logged_bytes * size if collective == "all_gather_into_tensor" else logged_bytes


def collective_s(profile: dict, collective: str, logged_bytes: float, size: int, *, inter: bool,
                 calls: int = 1) -> float:
    """Seconds for `calls` collectives moving `logged_bytes` in total (comms-logger sizes) over `size` ranks."""
    if size <= 1 or logged_bytes <= 0:
        return 0.0
    if collective == "all_gather":  # the list form (ZeRO-3 Muon) logs one input tensor too: the same ring gather
        collective = "all_gather_into_tensor"
    calls = max(calls, 1)
    if inter or collective not in ("send", "recv"):
        per_call = curve_s(profile, collective, size, full_bytes(collective, logged_bytes, size) / calls, inter)
        if per_call is not None:
            return calls * per_call
    bandwidth = bus_gbps(profile, collective, size, inter) * 1e9
    beta = BUS_FACTOR[collective](size) * full_bytes(collective, logged_bytes, size) / bandwidth
    steps = RING_STEPS[collective](size)
    if collective == "all_reduce":
        steps = min(steps, 2 * math.ceil(math.log2(size)))
    alpha = profile["inter_latency_us" if inter else "intra_latency_us"] * 1e-6
    return beta + calls * steps * alpha
