"""Ulysses sequence parallelism in the planner: the degrees a model allows and the all-to-all traffic.

Ulysses (Jacobs et al. 2023, arXiv 2309.14509; DeepSpeed's UlyssesSPAttentionHF, ALST arXiv 2506.13996 s3.2) splits
the sequence over sp ranks and, around each attention, switches q, k and v from sequence-split to head-split with
one all-to-all each, and the output back with a fourth. Backward runs the same four on the gradients; a recomputed
forward (activation checkpointing) four more. With t = seq_len x micro_batch / sp tokens per rank and d the width
of the tensor (heads x head_dim for q and the output, kv heads x head_dim for k and v; DeepSpeed repeats kv heads up
to sp when there are fewer, ulysses_sp.py kv_replication_factor), each all-to-all takes t x d x lp bytes in
(the comms logger's size) and sends (sp - 1) / sp of it to the other ranks. The sp ranks of a group are adjacent
(inside a node: the rung keeps sp <= GPUs per node), ZeRO shards over all sp x data-parallel ranks.
"""

from __future__ import annotations

from harness.config.defaults import PRECISION_BYTES
from harness.model_shapes import ulysses_splits_heads, ulysses_splits_kv_heads
from harness.planner.shape import ModelShape

A2A = "all_to_all_single"
A2A_PER_BLOCK = 4  # q, k, v in; the output back


def sp_problem(shape: ModelShape, sp: int) -> str | None:
    """Why Ulysses cannot split this model sp ways, or None."""
    heads, kv = shape.num_attention_heads, shape.num_key_value_heads
    if sp <= 1:
        return None
    if not ulysses_splits_heads(heads, sp):
        return f"{heads} attention heads do not divide by sp {sp}"
    if not ulysses_splits_kv_heads(kv, sp):
        return f"{kv} kv heads: neither kv % sp nor sp % kv is 0 (sp {sp})"
    return None


def sp_degrees(gpus_per_node: int, shape: ModelShape) -> list[int]:
    """The sp degrees > 1 the rung tries: divisors of the node's GPUs that the heads allow."""
    return [s for s in range(2, gpus_per_node + 1) if gpus_per_node % s == 0 and not sp_problem(shape, s)]


def a2a_widths(shape: ModelShape, sp: int) -> list[int]:
    """Elements per token of the four all-to-alls of one block: q, k, v, output."""
    d_attn = shape.num_attention_heads * shape.head_dim
    d_kv = max(shape.num_key_value_heads, sp) * shape.head_dim
    return [d_attn, d_kv, d_kv, d_attn]


def passes(activation_checkpointing: bool) -> int:
    """Forward, backward, and the recomputed forward."""
    return 3 if activation_checkpointing else 2


def a2a_calls(blocks: int, micro_batches: int, activation_checkpointing: bool) -> int:
    return A2A_PER_BLOCK * passes(activation_checkpointing) * blocks * micro_batches


def a2a_bytes_per_step(shape: ModelShape, *, seq_len: int, micro_batch: int, micro_batches: int, sp: int, blocks: int,
                       precision: str, activation_checkpointing: bool) -> dict[str, int]:
    """Logged bytes per rank per optimizer step of the sp group's all-to-alls ({} at sp 1)."""
    if sp <= 1:
        return {}
    tokens = -(-seq_len // sp) * micro_batch
    per_block = tokens * PRECISION_BYTES[precision] * sum(a2a_widths(shape, sp))
    return {A2A: per_block * passes(activation_checkpointing) * blocks * micro_batches}
