"""Memory a rank adds while it builds its model (pure: no torch).

Built by share (pipeline, tp, 3d), whole (ddp, ZeRO-1/2 through from_pretrained) or partitioned at construction
and filled module by module (ZeRO-3 of a safetensors folder, model/load/zero3.py):
  owned     the tensors the rank keeps, in the training dtype: its stage or shard; the whole model for ddp and
            ZeRO-1/2; its 1/N partition for ZeRO-3
  convert   one tensor read in the checkpoint's dtype while it is cast to the training dtype (none when the
            two agree: the read itself is the kept tensor)
  gathered  ZeRO-3: the largest module's own parameters, whole, while they are gathered. Filled from a folder
            (zero3_fill), twice that: measured on 2 gloo ranks (0.2B Llama, a 125 MiB embedding), the peak of
            gathering, filling and re-partitioning one module is its size twice on every rank, and rank 0's read
            of one tensor in the checkpoint's dtype (at most one such copy) is not live beside the second copy,
            so no convert term
  source    presets: the whole seeded model in fp32, which every path slices (none for checkpoint folders)
File pages of a memory-mapped checkpoint are not private memory and are not predicted here.
"""

from __future__ import annotations

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


def build_bytes(*, owned_params: int, train_dtype: str, checkpoint_dtype: str | None, largest_tensor_params: int,
                gathered_params: int = 0, source_params: int = 0, zero3_fill: bool = False) -> dict[str, int]:
    train = DTYPE_BYTES[train_dtype]
    ckpt = DTYPE_BYTES.get(checkpoint_dtype or train_dtype, train)
    out = {"owned": owned_params * train,
           "convert": 0 if ckpt == train or zero3_fill else largest_tensor_params * ckpt,
           "gathered": gathered_params * train * (2 if zero3_fill else 1),
           "source": source_params * DTYPE_BYTES["float32"]}
    out["total"] = sum(out.values())
    return out


def owned_params(count, *, pp: int = 1, tp: int = 1, stage: int = 0, method: str = "parameters") -> int:
    """Parameters one rank of `stage` holds after loading by share (a ParamCount from params.count_params): its
    pipeline stage (DeepSpeed's partition, planner/pipeline.py) with the blocks split over tp, or for tp alone
    the whole model with its blocks split. Data parallel and ZeRO-1/2 hold count.total."""
    from harness.planner import pipeline

    if pp > 1:
        return pipeline.stages(count, pp, method, tp)[stage]["params"]
    return count.total - count.num_layers * (count.per_layer - count.block_params(tp))
