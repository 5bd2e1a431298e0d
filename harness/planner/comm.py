"""Communication per optimizer step, per rank, per collective.

Two numbers per collective:
- logged bytes: the message sizes DeepSpeed's comms logger records (deepspeed-facts.md,
  "Communication"): all_reduce = the full tensor, all_gather_into_tensor = this rank's input shard,
  reduce_scatter_tensor = the full input, send/recv = the tensor. A run's metrics can be compared
  with these directly.
- wire bytes: what leaves this rank with ring algorithms: all_reduce 2(N-1)/N x M, all_gather
  (N-1) x shard, reduce_scatter (N-1)/N x M. This is the ZeRO paper's "DP all-reduce 2 Psi, ZeRO-3 1.5x".

DeepSpeed 0.19.8 as measured: ZeRO-0 all-reduces the 16-bit grads once per step; ZeRO-1/2 all-reduce
them (ZeRO-1 once per step, ZeRO-2 every micro-step) and all-gather the updated partitions; ZeRO-3
reduce-scatters every micro-step and all-gathers parameters in forward and again in backward (forward only
while they fit in stage3_max_live_parameters: zero3_gathers). Tiny
scalar all-reduces (overflow check, grad norm) are left out. ZeRO-3 Muon's own gathers in the step are
planner/optimizer.muon_comm_bytes, merged into the data-parallel group's. Pipeline (p2p), tensor-parallel and tied-embedding
traffic, and the bubble, are in pipeline.py.
"""

from __future__ import annotations

from harness.config.defaults import PRECISION_BYTES, STAGE3_MAX_LIVE_PARAMETERS


def comm_bytes_per_step(num_params: int, *, stage: int, zero_shards: int, precision: str, grad_accum: int = 1,
                        persistent_params: int = 0, gathers_per_micro_step: int = 2,
                        trainable_params: int | None = None) -> dict[str, int]:
    """Logged bytes per rank per optimizer step of the data-parallel (ZeRO) group.

    num_params: parameters this rank's ZeRO group shards. persistent_params: ZeRO-3 tensors kept whole
    (never gathered). gathers_per_micro_step: ZeRO-3 parameter all-gathers per micro-step (forward and
    backward: 2; a model small enough to stay live: 1). A group of one rank sends nothing on the wire
    (wire_bytes), but DeepSpeed still calls, and the comms logger logs, its gradient reductions (measured on
    one rank: all_reduce for ZeRO-0/1/2, reduce_scatter_tensor for ZeRO-3; no all-gather).
    trainable_params (LoRA; None = all): gradients and the updated ZeRO-1/2 partitions cover only these, while
    ZeRO-3 still all-gathers every parameter, frozen ones included.
    """
    if precision not in PRECISION_BYTES:
        raise ValueError(f"precision {precision!r}: expected one of {', '.join(PRECISION_BYTES)}")
    lp = PRECISION_BYTES[precision]
    trainable = num_params if trainable_params is None else trainable_params
    grads = lp * trainable
    shard = lp * -(-trainable // zero_shards) if zero_shards > 1 else 0
    if stage == 0:
        return {"all_reduce": grads}
    if stage in (1, 2):
        reduces = 1 if stage == 1 else grad_accum  # ZeRO-1 reduces at the accumulation boundary only
        return _nonzero({"all_reduce": grads * reduces, "all_gather_into_tensor": shard})
    if stage == 3:
        gathered = lp * -(-(num_params - persistent_params) // zero_shards) if zero_shards > 1 else 0
        # after every optimizer step ZeRO-3 re-gathers ALL persistent tensors, frozen ones too (stage3 _post_step)
        persistent = lp * -(-persistent_params // zero_shards) if zero_shards > 1 else 0
        return _nonzero({"reduce_scatter_tensor": grads * grad_accum,
                         "all_gather_into_tensor": gathered * gathers_per_micro_step * grad_accum + persistent})
    raise ValueError(f"zero stage {stage}: expected 0, 1, 2 or 3")


def zero3_gathers(gathered_params: int, max_live: int = STAGE3_MAX_LIVE_PARAMETERS) -> int:
    """ZeRO-3 parameter all-gathers per micro-step: it re-gathers in backward only when it had to release the
    parameters after forward, i.e. when the gathered parameters exceed stage3_max_live_parameters (measured on 2
    gloo ranks: a 7.4M-parameter Mixtral logs 14.7 MB of all_gather_into_tensor per step in fp32, one pass)."""
    return 1 if gathered_params <= max_live else 2


def merged(*ops: dict[str, int]) -> dict[str, int]:
    """Logged bytes per collective summed over several sources (ZeRO's and an optimizer's own, planner/optimizer)."""
    out: dict[str, int] = {}
    for part in ops:
        for op, n in part.items():
            out[op] = out.get(op, 0) + n
    return out


def _nonzero(ops: dict[str, int]) -> dict[str, int]:
    return {op: n for op, n in ops.items() if n}


def wire_bytes(collective: str, logged_bytes: int, group_size: int) -> int:
    """Bytes this rank sends for a logged message under ring algorithms."""
    n = group_size
    if n <= 1:
        return 0
    if collective == "all_reduce":
        return logged_bytes * 2 * (n - 1) // n
    if collective in ("all_gather_into_tensor", "all_gather"):  # logged: this rank's input (one tensor)
        return logged_bytes * (n - 1)
    if collective in ("reduce_scatter_tensor", "all_to_all_single"):  # all-to-all keeps 1/n of its input
        return logged_bytes * (n - 1) // n
    return logged_bytes  # send / recv: point to point


def comm_rows(groups: dict[str, tuple[dict, int]]) -> list[dict]:
    """Flatten {group: (logged {collective: bytes}, group size)} into rows with wire bytes."""
    rows = []
    for group, (logged, size) in groups.items():
        for collective, nbytes in logged.items():
            rows.append({"group": group, "collective": collective, "group_size": size,
                         "logged_bytes": int(nbytes), "wire_bytes": int(wire_bytes(collective, nbytes, size))})
    return rows
