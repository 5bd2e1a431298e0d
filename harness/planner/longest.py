"""The longest sequence a layout holds: `max_seq_len` of every layout `harness plan` shows.

Model states do not grow with the sequence; activations do (linearly with flash/flex attention, quadratically with a
materialised mask or eager scores; memory.activation_bytes). So the model states are evaluated once and the
activations alone are searched: doubling from sp tokens, then bisecting, in multiples of sp (Ulysses needs
seq_len % sp == 0), against the same verdict as layouts.evaluate: backward's model states plus the activations under
the usable GPU memory, and, with activation offload, the node's offloaded bytes under its usable CPU RAM. Offloaded
model states (optimizer and parameters in CPU RAM or on NVMe) count where they are: CPU RAM beside the offloaded
activations; NVMe once, since no length fits when they do not.
"""

from __future__ import annotations

from harness.planner import layouts
from harness.planner.inputs import Cluster, Workload
from harness.planner.shape import ModelShape

LIMIT = 1 << 34  # 17 billion tokens: no layout is searched past this


def max_seq_len(c: layouts.Candidate, count, shape: ModelShape, cluster: Cluster, work: Workload) -> int:
    """The longest seq_len (a multiple of c.sp) at which layout `c` fits with this workload's micro-batch and
    precision; 0 when not even sp tokens fit (or the layout does not apply). Learned positions cap it."""
    base = layouts.evaluate(c, count, shape, cluster, work.but(seq_len=c.sp))
    if not base["applicable"] and "seq_len" not in (base["why_not"] or ""):
        return 0
    mem = base["memory"]
    states_gpu = mem["gpu_backward_bytes"] - mem["activations"]["total"]
    states_cpu = mem["cpu_bytes_per_rank"] - mem["activations"]["cpu_offload"]
    usable, usable_cpu, gpn = cluster.usable_gpu_bytes, cluster.usable_cpu_bytes, cluster.gpus_per_node
    nvme = mem["nvme_bytes_per_node"]  # model states on NVMe do not grow with the sequence: no room, no length
    if mem["gpu_step_bytes"] > usable or nvme and (cluster.usable_nvme_bytes or 0) < nvme:
        return 0
    in_flight = min(c.pp, base["micro_batches"])

    def fits(units: int) -> bool:
        acts = layouts.activations(c, shape, work.but(seq_len=units * c.sp), base["blocks_per_rank"], in_flight)
        cpu_ok = usable_cpu is None or (states_cpu + acts["cpu_offload"]) * gpn <= usable_cpu
        return states_gpu + acts["total"] <= usable and cpu_ok

    cap = LIMIT // c.sp
    if shape.learned_positions and shape.max_positions:
        cap = min(cap, shape.max_positions // c.sp)
    if cap < 1 or not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= cap and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, cap + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * c.sp


def attach(result: dict, count, shape: ModelShape, cluster: Cluster, work: Workload) -> dict:
    """Add max_seq_len to an evaluated layout (layouts.evaluate's dict) and return it."""
    result["max_seq_len"] = max_seq_len(layouts.candidate_of(result), count, shape, cluster, work)
    return result
