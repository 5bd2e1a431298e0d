"""The optimizer's widths in the plan: bf16 master weights and optimizer states, Muon (docs/optimizers.md).

The decision order gains ZeRO-2 and ZeRO-3 with the optimizer state in bf16 (DeepSpeed's
bf16_master_weights_and_grads + bf16_optimizer_states): 6 bytes per parameter less before sharding, nothing moved
off the GPU, no traffic added. They come after the exact ZeRO-3, before offload, and a time ranking never picks
them over an exact layout: their cost is loss. Measured (bench/optimizer_states.py, 200 steps, decaying lr), the
run ends 17 % higher in loss than with fp32 states, and bf16 master weights with fp32 states (the CPU-offload
form) end the same, so the bf16 master copy is the cause: it keeps 8 mantissa bits and drops every update under
about 1/256 of a weight, more of them as the lr decays. Offered only where DeepSpeed takes it (bf16 training;
Adam-family or Muon states) and the run does not already ask for bf16 states.
"""

from __future__ import annotations

import math
from collections import OrderedDict

from harness.config.defaults import PRECISION_BYTES
from harness.config.optimizer_rules import INT8_STATES_REASON
from harness.config.run_model import ADAM_STATES, OptimizerDtypes
from harness.planner.inputs import Workload

RUNG_RECIPE = "zero2_bf16_states"
RUNG_COST = ("master weights and optimizer states in bf16: 6 B/param less than fp32 before sharding, on the GPU, "
             "no traffic added; the cost is loss: the bf16 master copy drops updates under ~1/256 of a weight "
             "(measured: +17 % loss after 200 steps of a decaying lr; docs/optimizers.md), so exact layouts go first; "
             "with AdamW, optimizer.stochastic_rounding (recipe zero2_bf16_sr: torchao's _AdamW) keeps "
             "these bytes, no fp32 copy, and measured +0.24 % instead")


def from_flags(optimizer: str, master_dtype: str, state_dtype: str, precision: str) -> OptimizerDtypes:
    """`harness plan --optimizer --master-dtype --state-dtype` as widths; what DeepSpeed refuses, said up front."""
    if state_dtype == "int8":
        raise ValueError(f"--state-dtype int8: {INT8_STATES_REASON}; use --master-dtype bf16 --state-dtype bf16")
    if state_dtype == "bf16" and master_dtype != "bf16":
        raise ValueError("--state-dtype bf16 needs --master-dtype bf16 (DeepSpeed: bf16_optimizer_states requires "
                         "bf16_master_weights_and_grads)")
    if "bf16" in (master_dtype, state_dtype) and precision != "bf16":
        raise ValueError(f"--master-dtype/--state-dtype bf16 with --precision {precision}: they are copies of bf16 "
                         "weights and gradients; use --precision bf16")
    return OptimizerDtypes.named(optimizer, master_dtype, state_dtype)


def offers_rung(work: Workload) -> bool:
    """Whether the decision order gains the bf16-states rung for this workload."""
    dtypes = work.optimizer_dtypes
    adam_like = work.optimizer_states == ADAM_STATES or dtypes.muon
    return work.precision == "bf16" and adam_like and dtypes.master_bytes == 4 and dtypes.state_bytes == 4


def dtypes_for(c, work: Workload) -> OptimizerDtypes:
    """The widths a candidate trains with: the rung's bf16, else the workload's (stage 0 keeps fp32: DeepSpeed
    takes bf16 master weights on ZeRO 1-3 only, and the candidate is refused then)."""
    if getattr(c, "states", "") == "bf16":
        return OptimizerDtypes(2, 2, work.optimizer_dtypes.muon)
    return work.optimizer_dtypes


def refusal(c, work: Workload) -> str | None:
    """Why DeepSpeed (or the harness, config/optimizer_rules.py) refuses this candidate with the workload's
    optimizer, or None."""
    dtypes = dtypes_for(c, work)
    low = dtypes.master_bytes == 2 or dtypes.state_bytes == 2
    if low and c.stage == 0:
        return "bf16 master weights / optimizer states need ZeRO 1-3"
    if dtypes.master_bytes == 2 and dtypes.state_bytes == 4 and c.offload_optimizer != "cpu":
        return "bf16 master weights with fp32 states need optimizer offload to the CPU (DeepSpeedCPUAdam)"
    if dtypes.muon and c.stage == 0:
        return "Muon runs on ZeRO 1-3 here"
    if dtypes.muon and c.offload_optimizer != "none":
        return "Muon with optimizer offload is refused (an unpriced gather path in DeepSpeed 0.19.8)"
    return None


def overrides(c, work: Workload) -> dict:
    """The --set overrides that carry the workload's optimizer into the named recipe."""
    dtypes, out = dtypes_for(c, work), {}
    in_recipe = c.recipe == RUNG_RECIPE  # its recipe already says bf16 master and states
    if dtypes.muon:
        out["optimizer.type"] = "muon"
    if dtypes.master_bytes == 2 and not in_recipe:
        out["optimizer.master_dtype"] = "bf16"
    if dtypes.state_bytes == 2 and not in_recipe:
        out["optimizer.state_dtype"] = "bf16"
    return out


def holding(dtypes: OptimizerDtypes, params: int, count, zero_shards: int = 0) -> dict:
    """memory.Holding's width fields for a rank holding `params` of a model counted as `count` (params.ParamCount):
    Muon's share in proportion where tensor or pipeline splits leave the rank a part; with zero_shards, the Muon
    matrices a ZeRO-1/2 rank holds whole (from their shapes)."""
    out = {"master_bytes": dtypes.master_bytes, "state_bytes": dtypes.state_bytes}
    if dtypes.muon and count is not None and count.muon_params:
        whole = params >= count.total
        out["muon_params"] = count.muon_params if whole else params * count.muon_params // count.total
        if whole and count.muon_shapes and zero_shards:
            out["muon_whole"] = muon_partition_elems(count.muon_shapes, zero_shards)
    return out


def muon_partition_elems(shapes, zero_shards: int) -> int:
    """The largest number of Muon elements a ZeRO-1/2 rank holds whole. DeepSpeed's MuonWithAuxAdam sorts its
    parameters by shape, largest first (original_muon.py), ZeRO flattens them in that order and pads to a multiple
    of 2 x zero_shards (nccl_start_alignment_factor), and a rank folds the momentum of every tensor its partition
    touches (stage_1_and_2._muon_momentum_buffer). shapes: ((shape, count), ...) as ParamCount.muon_shapes."""
    sizes = [math.prod(shape) for shape, count in sorted(shapes, reverse=True) for _ in range(count)]
    total = sum(sizes)
    alignment = 2 * zero_shards
    part = -(-total // alignment) * alignment // zero_shards
    held, start = [0] * zero_shards, 0
    for n in sizes:  # every rank whose partition [rank x part, (rank + 1) x part) the tensor touches holds it whole
        for rank in range(start // part, min((start + n - 1) // part, zero_shards - 1) + 1):
            held[rank] += n
        start += n
    return max(held)



def gathers(dtypes: OptimizerDtypes, stage: int, groups, zero_shards: int, buckets, precision: str) -> dict:
    """memory.Holding's muon_gathers of a ZeRO-3 Muon rank whose ZeRO group holds the Muon sub-groups `groups`
    (muon_sub_groups, or the live engine's); none elsewhere (ZeRO-1/2 price theirs as optimizer states)."""
    if not (dtypes.muon and stage == 3 and groups):
        return {}
    return {"muon_gathers": muon_gather_cache_bytes(groups, zero_shards, buckets.reduce_bucket_elems,
                                                    PRECISION_BYTES[precision])}


def gathers_of(dtypes: OptimizerDtypes, stage: int, count, zero_shards: int, buckets, precision: str,
               zero_init: bool = True) -> dict:
    """gathers() from the model's count (params.ParamCount): its Muon matrices in muon_order, sub-grouped as ZeRO-3
    sub-groups them."""
    return gathers(dtypes, stage, groups_of(dtypes, stage, count, zero_shards, buckets, zero_init), zero_shards,
                   buckets, precision)


def groups_of(dtypes: OptimizerDtypes, stage: int, count, zero_shards: int, buckets, zero_init: bool = True) -> list:
    """ZeRO-3 Muon's sub-groups from the model's count (muon_sub_groups of muon_order); none elsewhere."""
    if not (dtypes.muon and stage == 3 and count.muon_shapes):
        return []
    return muon_sub_groups(muon_order(count, zero_init), zero_shards, buckets.sub_group_elems)


def chunk_note(dtypes: OptimizerDtypes, stage: int, groups, zero_shards: int, buckets, precision: str) -> str | None:
    """ZeRO-3 Muon whose chunks (reduce_bucket_size) hold fewer matrices than the ZeRO group has ranks: DeepSpeed
    0.19.8 hands a chunk's matrices out round-robin, so the other ranks do no Newton-Schulz and send a padded whole
    matrix per round. What it costs and the bucket that spreads it; None when every chunk has work for each rank."""
    if not (dtypes.muon and stage == 3 and groups and zero_shards > 1):
        return None
    chunks = list(_muon_chunks(groups, buckets.reduce_bucket_elems))
    most = max(len(c) for c in chunks)
    if most >= zero_shards:
        return None
    largest = max(max(c) for c in chunks)
    more = PRECISION_BYTES[precision] * (zero_shards * largest - buckets.reduce_bucket_elems)  # ZeRO-3: one bucket
    return (f"ZeRO-3 Muon: zero_optimization.reduce_bucket_size {buckets.reduce_bucket_elems:,} packs at most {most} "
            f"Muon matri{'x' if most == 1 else 'ces'} per chunk for {zero_shards} ranks: DeepSpeed 0.19.8 gives a "
            f"chunk's matrices out one per rank, so {zero_shards - most} of {zero_shards} ranks run no Newton-Schulz "
            f"and every rank sends a padded whole matrix per round (priced in the comm's muon rows). A bucket of "
            f"{zero_shards} x the largest matrix (the run's --set zero.reduce_bucket_size={zero_shards * largest}) "
            f"spreads it, for {more / 1e9:.2f} GB more of reduce bucket per rank (and Muon's cached gather buffers, "
            f"at most {MUON_GATHER_CACHE_BYTES // 2**20} MiB)")


def comm(dtypes: OptimizerDtypes, stage: int, groups, zero_shards: int, buckets, precision: str) -> dict[str, int]:
    """ZeRO-3 Muon's logged bytes per step (muon_comm_bytes) for the sub-groups `groups`; {} elsewhere (ZeRO-1/2
    Muon reduces as AdamW does)."""
    if not (dtypes.muon and stage == 3 and groups):
        return {}
    return muon_comm_bytes(groups, zero_shards, buckets.reduce_bucket_elems, PRECISION_BYTES[precision])

# stage3._muon_allgather_max_cached_bytes: the most DeepSpeed 0.19.8's ZeRO-3 Muon keeps of its gather buffers
MUON_GATHER_CACHE_BYTES = 256 * 2**20


def muon_gather_cache_bytes(groups, zero_shards: int, reduce_bucket_elems: int, comm_bytes: int) -> int:
    """Bytes of the gather buffers ZeRO-3 Muon keeps between steps, on one rank. Each step DeepSpeed
    (stage3._apply_muon_to_accumulated_grads) walks every Muon sub-group in chunks of whole matrices, greedily
    packed up to reduce_bucket_size elements (a larger matrix alone), and all-gathers each chunk's gradient, then
    its momentum, through _partitioned_buffers_all_gather. That keeps, per distinct chunk partition length L
    (the sum of the chunk's partition_numel, ceil(numel / zero_shards)), a local buffer of L and a gather buffer
    of zero_shards x L in the communication dtype, least recently used evicted above 256 MiB, a buffer pair over
    256 MiB not kept. None with one rank. groups: the Muon sub-groups, each its matrices' elements in the
    optimizer's order (muon_sub_groups)."""
    if zero_shards <= 1:
        return 0
    cache: OrderedDict[int, int] = OrderedDict()
    for chunk in _muon_chunks(groups, reduce_bucket_elems):
        local = sum(-(-n // zero_shards) for n in chunk)
        nbytes = (1 + zero_shards) * local * comm_bytes
        if local in cache:
            cache.move_to_end(local)
        elif nbytes <= MUON_GATHER_CACHE_BYTES:
            while cache and sum(cache.values()) + nbytes > MUON_GATHER_CACHE_BYTES:
                cache.popitem(last=False)
            cache[local] = nbytes
    return sum(cache.values())


def _muon_chunks(groups, reduce_bucket_elems: int):
    """The chunks stage3._apply_muon_to_accumulated_grads walks each Muon sub-group in: whole matrices packed
    greedily up to reduce_bucket_size elements, a larger matrix alone."""
    for group in groups:
        start = 0
        while start < len(group):
            end, numel = start + 1, group[start]
            while end < len(group) and numel + group[end] <= reduce_bucket_elems:
                numel += group[end]
                end += 1
            yield group[start:end]
            start = end


def muon_comm_bytes(groups, zero_shards: int, reduce_bucket_elems: int, comm_bytes: int) -> dict[str, int]:
    """Logged bytes per optimizer step of ZeRO-3 Muon's own collectives on one rank (planner/comm.py's
    convention), DeepSpeed 0.19.8's stage3._apply_muon_to_accumulated_grads: per chunk (_muon_chunks) two
    all_gather_into_tensor of the chunk's partitions (the gradients, then the momentum; none with one rank), then
    per round of zero_shards matrices, where each rank orthogonalizes one, two all_gathers of one whole matrix per
    rank (the updates, then the momentum; a round of fewer or unequal matrices padded to its largest). With chunks
    of at least zero_shards matrices about 4 x the Muon matrices' bytes / zero_shards per rank; with one matrix a
    chunk (chunk_note) the all_gathers alone are 2 x the Muon bytes. On top of ZeRO-3's passes over all parameters."""
    into = gather = 0
    for chunk in _muon_chunks(groups, reduce_bucket_elems):
        if zero_shards > 1:
            into += 2 * comm_bytes * sum(-(-n // zero_shards) for n in chunk)
        gather += sum(2 * comm_bytes * max(chunk[i:i + zero_shards]) for i in range(0, len(chunk), zero_shards))
    return {op: n for op, n in (("all_gather_into_tensor", into), ("all_gather", gather)) if n}


def muon_sub_groups(sizes: list[int], zero_shards: int, sub_group_elems: int) -> list[list[int]]:
    """The Muon matrices (elements, muon_order) as ZeRO-3 sub-groups them (stage3._create_fp16_sub_groups): a new
    sub-group once the partition elements reach zero_optimization.sub_group_size."""
    if sum(-(-n // zero_shards) for n in sizes) <= sub_group_elems:
        return [sizes]
    out, current, held = [], [], 0
    for n in sizes:
        current.append(n)
        held += -(-n // zero_shards)
        if held >= sub_group_elems:
            out.append(current)
            current, held = [], 0
    return out + ([current] if current else [])


def muon_order(count, zero_init: bool = True) -> list[int]:
    """The Muon matrices' elements in the order ZeRO-3 holds them. MuonWithAuxAdam sorts them by size(), largest
    first; under zero.Init (the harness's ZeRO-3 load) every size() is [0] then, so they keep the model's order:
    the count's shapes held once (embeddings) first, then one block's (count / layers each) per layer."""
    shapes = list(count.muon_shapes)
    if not zero_init:
        return [math.prod(s) for s, n in sorted(shapes, reverse=True) for _ in range(n)]
    layers = max(1, count.num_layers)
    once = [math.prod(s) for s, n in shapes if n % layers for _ in range(n)]
    block = [math.prod(s) for s, n in shapes if not n % layers for _ in range(n // layers)]
    return once + block * layers
