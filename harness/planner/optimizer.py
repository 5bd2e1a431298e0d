"""The optimizer's widths in the plan: bf16 master weights and optimizer states, Muon (docs/optimizers.md).

The decision order's rung after plain ZeRO-2 (and again after ZeRO-3, before offload) is the one users take first in
2026: keep the layout and shrink the optimizer state to bf16 (DeepSpeed's bf16_master_weights_and_grads +
bf16_optimizer_states): 6 bytes per parameter less before sharding, nothing moved off the GPU, no traffic added.
Its cost is precision, not time: the bf16 master copy keeps 8 mantissa bits, so an update smaller than about 1/256
of a weight is lost. It is offered only where
DeepSpeed takes it (bf16 training; Adam-family or Muon states) and the run does not already ask for bf16 states.
"""

from __future__ import annotations

import math

from harness.config.optimizer_rules import INT8_STATES_REASON
from harness.config.run_model import ADAM_STATES, OptimizerDtypes
from harness.planner.inputs import Workload

RUNG_RECIPE = "zero2_bf16_states"
RUNG_COST = ("master weights and optimizer states in bf16: 6 B/param less than fp32 before sharding, on the GPU, "
             "no traffic added; the cost is precision (a bf16 master copy loses updates under ~1/256 of a weight; "
             "docs/optimizers.md)")


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
