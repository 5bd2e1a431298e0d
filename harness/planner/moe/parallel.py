"""Mixture-of-Experts layouts: expert parallelism (DeepSpeed AutoEP) against ZeRO-3 with the sparse block as leaf.

Memory per rank with expert parallelism degree ep (DeepSpeed 0.19.8 AutoEP, `parallel.expert`): the routed
experts of every sparse block are split over the ep ranks of an expert-parallel group (E / ep experts each), and
ZeRO shards their 16-bit copies, gradients and optimizer states over the expert-data-parallel group (the world / ep
ranks that hold the same experts); everything else (attention, router, shared experts, embeddings) is sharded by
ZeRO over all ranks, as in a dense model. Buffers (reduce buckets, ZeRO-3's gathered parameters) are counted once.

ZeRO-3 with leaves (`zero_optimization.leaf_module`, what the harness sets for a MoE model): a sparse block is
gathered whole, router, routed and shared experts at once, so the largest module ZeRO-3 holds gathered is one
sparse block (ParamCount.moe_block), not one projection.

All-to-all (deepspeed/module_inject/auto_ep_layer.py, the all_to_all_single path): per sparse block and
micro-batch, forward sends each token's top_k routed copies to the ranks holding their experts (dispatch) and
brings the expert outputs back (combine), two all_to_all_single calls of tokens x top_k x hidden elements in the
training precision (_AllToAllV); backward runs both in reverse, two more; a recomputed forward (activation
checkpointing) two more. The comms logger logs each call at its input (what the rank sends): tokens x top_k rows
for the dispatch and the combine's backward, what its experts received for the other two, so a rank's figure is
the balanced one and the sum over the expert-parallel group is exact for any routing (tests/test_moe_plan_bytes.py);
the wire carries the (ep - 1) / ep of it bound for other ranks. Also one all_to_all_single of the E token counts per sparse
block in forward (E int64: too small to model, like the scalar all-reduces).

Imbalance: with ep > 1 the rank whose experts receive the most tokens sets the pace of every sparse block.
`expert_imbalance` (max / mean tokens per expert-parallel rank, DEFAULT_IMBALANCE unless given: the router's
load-balancing loss on keeps it near 1; `harness report` shows the measured ratio per layer) scales the routed
experts' compute and the all-to-all time of EP layouts. Without EP every rank runs its own tokens through all
experts it needs, so imbalance shifts work between experts on one rank, not between ranks.
"""

from __future__ import annotations

from dataclasses import replace

from harness.config.defaults import PRECISION_BYTES
from harness.config.moe_families import AUTOEP_FAMILIES
from harness.planner import comm, memory
from harness.planner.inputs import Workload

DEFAULT_IMBALANCE = 1.1
EP_STAGES = (1, 2)  # ZeRO stages the planner pairs with AutoEP (ZeRO-3 + AutoEP has limits: no SP, hpZ, qgZ)
A2A_PER_BLOCK = {False: 4, True: 6}  # dispatch + combine: forward, backward (+ recomputed forward)
STATE_TERMS = ("params", "grads", "fp32_master", "optimizer_moments", "fp32_grads")


def ep_degrees(world: int, gpus_per_node: int, num_experts: int) -> list[int]:
    """Expert-parallel degrees to try: >= 2, dividing the experts, the world and a node (the all-to-all stays on
    the node's fast links)."""
    if not num_experts:
        return []
    return [ep for ep in range(2, gpus_per_node + 1)
            if gpus_per_node % ep == 0 and world % ep == 0 and num_experts % ep == 0]


def ep_problem(model_type: str | None, num_experts: int, ep: int, world: int | None = None) -> str | None:
    """Why expert parallelism of degree ep cannot run this model on `world` ranks, or None."""
    if ep <= 1:
        return None
    if not num_experts:
        return f"expert parallelism needs a Mixture-of-Experts model; {model_type} has no routed experts"
    if model_type not in AUTOEP_FAMILIES:
        return (f"DeepSpeed AutoEP cannot place the experts of {model_type} models (presets: "
                f"{', '.join(AUTOEP_FAMILIES)})")
    if num_experts % ep:
        return f"{num_experts} experts do not split over ep {ep}: {num_experts} / {ep} = {num_experts / ep:g}"
    if world is not None and world % ep:
        return f"ep {ep} does not divide the {world} ranks: {world} / {ep} = {world / ep:g}"
    return None


def split(count, ep: int) -> tuple[int, int]:
    """(parameters ZeRO shards over every rank, routed expert parameters on this rank before ZeRO)."""
    return count.total - count.routed_experts, count.routed_experts // ep


def rank_params(count, ep: int) -> int:
    dense, experts = split(count, ep)
    return dense + experts


def model_state_bytes(count, held: memory.Holding, zero, *, ep: int, zero_shards: int, **kw) -> dict:
    """memory.model_state_bytes for a rank of an ep-way expert-parallel layout: the non-expert parameters over
    the zero_shards ranks, this rank's experts over the zero_shards / ep ranks of its expert-data-parallel group
    (held's params replaced by those two shares); the buffers (buckets, staging, gathered parameters) of the
    non-expert call only."""
    dense, experts = split(count, ep)
    out = memory.model_state_bytes(replace(held, params=dense), zero, zero_shards=zero_shards, **kw)
    theirs = memory.model_state_bytes(replace(held, params=experts), zero, zero_shards=max(1, zero_shards // ep), **kw)
    for term in STATE_TERMS:
        for device, nbytes in theirs[term].items():
            out[term][device] += nbytes
    return out


def all_to_all_bytes(count, hidden: int, *, ep: int, seq_len: int, micro_batch: int, micro_batches: int,
                     precision: str, activation_checkpointing: bool) -> int:
    """Logged all_to_all_single bytes per rank per optimizer step (module doc)."""
    if ep <= 1 or not count.moe_layers:
        return 0
    per_call = seq_len * micro_batch * count.top_k * hidden * PRECISION_BYTES[precision]
    return per_call * A2A_PER_BLOCK[bool(activation_checkpointing)] * count.moe_layers * micro_batches


def all_to_all_calls(count, *, micro_batches: int, activation_checkpointing: bool) -> int:
    return A2A_PER_BLOCK[bool(activation_checkpointing)] * count.moe_layers * micro_batches


def comm_groups(count, work: Workload, *, ep: int, stage: int, zero_shards: int, hidden: int) -> dict:
    """comm.comm_rows groups of an EP layout training `work` (no pipeline: its grad_accum micro-batches per step):
    the non-expert gradients over the ZeRO group ("dp", zero_shards ranks), the experts' over the expert-data-parallel
    group ("edp", zero_shards / ep ranks), the all-to-all over the expert-parallel group ("ep")."""
    dense, experts = split(count, ep)
    edp, precision, grad_accum = max(1, zero_shards // ep), work.precision, work.grad_accum
    groups = {"dp": (comm.comm_bytes_per_step(dense, stage=stage, zero_shards=zero_shards, precision=precision,
                                              grad_accum=grad_accum), zero_shards),
              "edp": (comm.comm_bytes_per_step(experts, stage=stage, zero_shards=edp, precision=precision,
                                               grad_accum=grad_accum), edp)}
    a2a = all_to_all_bytes(count, hidden, ep=ep, seq_len=work.seq_len, micro_batch=work.micro_batch,
                           micro_batches=grad_accum, precision=precision,
                           activation_checkpointing=work.activation_checkpointing)
    groups["ep"] = ({"all_to_all_single": a2a}, ep)
    return groups


def optimizer_shard(count, ep: int, stage: int, zero_shards: int) -> int:
    """Parameters this rank's optimizer steps."""
    dense, experts = split(count, ep)
    if stage == 0:
        return dense + experts
    return -(-dense // zero_shards) + -(-experts // max(1, zero_shards // ep))


def routed_flops_per_token(count) -> float:
    """Forward FLOPs of the routed experts one token goes through, over all sparse blocks (2 per weight)."""
    if not count.num_experts:
        return 0.0
    return 2.0 * count.top_k * count.routed_experts / count.num_experts


def activation_width(count, hidden: int, default: int) -> int:
    """The MLP width a token's activations see in a sparse block: top_k experts' intermediate size (one expert
    holds ~3 x hidden x I parameters), for the planner's activation count; `default` for a dense model."""
    if not count.num_experts or not count.moe_layers:
        return default
    per_expert = count.routed_experts // (count.moe_layers * count.num_experts)
    return max(default, count.top_k * per_expert // (3 * hidden))
