"""Tensor parallelism for Llama-family decoder layers (Llama, Mistral, Qwen2), Megatron style, in place.

Per decoder layer, over a process group of `size` ranks:
  attention  q/k/v column-parallel: rank r keeps query heads [r*h/size, (r+1)*h/size) and kv heads
             [r*kv/size, ...) with their rows of the weights and biases; o row-parallel (its input columns).
  MLP        gate/up column-parallel (intermediate units), down row-parallel.
The attention and MLP inputs pass through `_CopyToGroup` (identity forward; backward all-reduces the input
gradient, since each rank only sees the part of dL/dx flowing through its own columns). The row-parallel
outputs pass through `_ReduceFromGroup` (forward all-reduce of the per-rank partial sums; identity backward),
and a row-parallel bias is added once, after the sum. Norms, embeddings and the LM head stay whole on every
rank: their inputs and output gradients are equal on every rank, so their gradients and updates are too.

transformers 5 reshapes q/k/v with -1 heads and reads num_key_value_groups (heads per kv head, unchanged when
both counts divide by size) from the module, so shrinking the projections is all the attention needs; the
rotary embeddings arrive as forward arguments, so a layer outside a full model (a pipeline stage) works too.

Split parameters carry tensor_model_parallel / partition_dim / partition_stride: DeepSpeed's gradient norm
(ZeRO-1/2 get_grad_norm_direct, runtime.utils clip_grad_norm_) sums their squares on every rank and those of
replicated parameters on model-parallel rank 0 only, then all-reduces over the model-parallel group.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

from harness.errors import UsageError
from harness.model_shapes import LLAMA_LIKE, shape_summary, tp_problems

# One table for splitting and merging: submodule -> (column-parallel linears, row-parallel linear).
COLUMN = {"self_attn": ("q_proj", "k_proj", "v_proj"), "mlp": ("gate_proj", "up_proj")}
ROW = {"self_attn": "o_proj", "mlp": "down_proj"}


def _all_reduce(tensor: torch.Tensor, group) -> torch.Tensor:
    """Sum over the group. Through deepspeed.comm when it is set up, so its comms logger counts TP traffic."""
    ds_comm = sys.modules.get("deepspeed.comm")  # not imported: cannot be set up (unit tests without DeepSpeed)
    if ds_comm is not None and ds_comm.is_initialized():
        ds_comm.all_reduce(tensor, group=group)
    else:
        torch.distributed.all_reduce(tensor, group=group)
    return tensor


class _CopyToGroup(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce backward (before column-parallel linears)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.contiguous().clone(), ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward (after row-parallel linears)."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class RowParallelLinear(nn.Linear):
    """nn.Linear holding this rank's input columns; output summed over the group, then the (whole) bias added.
    A subclass so parameter names (weight, bias) and state-dict keys stay those of the HF model."""

    tp_group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _ReduceFromGroup.apply(F.linear(x, self.weight), self.tp_group)
        return out if self.bias is None else out + self.bias


def supported(config, tp: int = 1) -> None:
    """Refuse a model these layers cannot split `tp` ways (UsageError naming the model type / the arithmetic)."""
    shape = shape_summary(config.to_dict() if hasattr(config, "to_dict") else dict(config))
    if shape["model_type"] is None:
        raise UsageError(f"tensor parallel: the model config has no model_type\n"
                         f"    fix: use a {', '.join(LLAMA_LIKE)} model")
    problems = tp_problems(shape, tp, getattr(config, "name_or_path", "") or "")
    if problems:
        raise UsageError("tensor parallel: " + "; ".join(w for w, _ in problems) + f"\n    fix: {problems[0][1]}")


def _mark(param: nn.Parameter, dim: int) -> nn.Parameter:
    param.tensor_model_parallel = True
    param.partition_dim = dim
    param.partition_stride = 1
    return param


def _split(tensor: torch.Tensor, dim: int, rank: int, size: int) -> nn.Parameter:
    return _mark(nn.Parameter(tensor.detach().chunk(size, dim)[rank].clone()), dim)


def _column_parallel(linear: nn.Linear, rank: int, size: int) -> None:
    linear.weight = _split(linear.weight, 0, rank, size)
    if linear.bias is not None:
        linear.bias = _split(linear.bias, 0, rank, size)
    linear.out_features //= size


def _row_parallel(linear: nn.Linear, group, rank: int, size: int) -> RowParallelLinear:
    new = RowParallelLinear(linear.in_features // size, linear.out_features, bias=linear.bias is not None,
                            device="meta", dtype=linear.weight.dtype)
    new.weight = _split(linear.weight, 1, rank, size)
    new.bias = linear.bias  # replicated: added once after the all-reduce
    new.tp_group = group
    return new


def _copy_input_hook(group):
    """Forward pre-hook putting the block's hidden_states (positional or keyword) through _CopyToGroup."""
    def hook(module, args, kwargs):
        if args:
            return (_CopyToGroup.apply(args[0], group), *args[1:]), kwargs
        kwargs["hidden_states"] = _CopyToGroup.apply(kwargs["hidden_states"], group)
        return args, kwargs
    return hook


def shard_decoder_layer(layer: nn.Module, config, group, rank: int, size: int) -> None:
    """Split one HF decoder layer over `group` (this process is `rank` of `size`), in place."""
    supported(config, size)
    if getattr(layer, "tp_size", 1) != 1:
        raise RuntimeError(f"decoder layer is already split {layer.tp_size} ways")
    if size == 1:
        return
    for block_name, columns in COLUMN.items():
        block = getattr(layer, block_name)
        for name in columns:
            _column_parallel(getattr(block, name), rank, size)
        setattr(block, ROW[block_name], _row_parallel(getattr(block, ROW[block_name]), group, rank, size))
        block.register_forward_pre_hook(_copy_input_hook(group), with_kwargs=True)
    attn = layer.self_attn
    for attr, total in (("num_heads", config.num_attention_heads), ("num_key_value_heads", config.num_key_value_heads)):
        if hasattr(attn, attr):  # older transformers read these in forward; 5.x reshapes with -1
            setattr(attn, attr, total // size)
    layer.tp_size = size


def shard_model(model: nn.Module, group, rank: int, size: int) -> None:
    """Split every decoder layer of a full HF causal LM (model.model.layers)."""
    supported(model.config, size)
    for layer in model.model.layers:
        shard_decoder_layer(layer, model.config, group, rank, size)


def _split_dim(key: str) -> int | None:
    """0 for column-parallel weights/biases, 1 for row-parallel weights, None for replicated tensors. LoRA on a
    split projection (parallel/tensor_lora.py, peft's names): a column-parallel B by rows, a row-parallel A by
    columns, the other half whole."""
    parts = key.replace(".base_layer.", ".").split(".")
    if len(parts) >= 5 and parts[-2] == "default" and parts[-3] in ("lora_A", "lora_B") and parts[-5] in COLUMN:
        block, name, half = parts[-5], parts[-4], parts[-3]
        if name in COLUMN[block]:
            return 0 if half == "lora_B" else None
        return 1 if name == ROW[block] and half == "lora_A" else None
    if len(parts) < 3 or parts[-3] not in COLUMN:
        return None
    block, name, kind = parts[-3:]
    if name in COLUMN[block]:
        return 0
    if name == ROW[block] and kind == "weight":
        return 1
    return None


def universal_patterns() -> tuple[str, str]:
    """(replicated, row-parallel): regular expressions over parameter names that say what _split_dim says, for
    DeepSpeed's ds_to_universal (it joins the tensor ranks' slices: replicated ones taken whole, row-parallel
    along dim 1, all others along dim 0). Layer-index agnostic, so one pair covers every stage of a pipeline."""
    column = "|".join(f"{block}\\.{name}" for block, names in COLUMN.items() for name in names)
    row = "|".join(f"{block}\\.{name}" for block, name in ROW.items())
    split_row = rf"\.(?:{row})\.(?:base_layer\.)?(?:weight|lora_A\.default\.weight)$"
    split_column = rf"\.(?:{column})\.(?:base_layer\.)?(?:weight|bias|lora_B\.default\.weight)$"
    return rf"^(?!.*{split_column})(?!.*{split_row}).*$", rf"^.*{split_row}"


def merged_shape(key: str, shapes: list) -> tuple[int, ...]:
    """The whole tensor's shape from its TP-rank shapes (rank order), without reading any of them."""
    dim, whole = _split_dim(key), list(shapes[0])
    if dim is not None:
        whole[dim] = sum(shape[dim] for shape in shapes)
    return tuple(whole)


def merge_tensor(key: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """One tensor's TP-rank pieces (rank order) -> the whole tensor: export streams tensor by tensor."""
    dim = _split_dim(key)
    return parts[0] if dim is None else torch.cat(parts, dim=dim)


class TensorDataMPU:
    """The model-parallel unit deepspeed.initialize(mpu=...) reads: tensor-parallel groups of `tp` consecutive
    ranks (inside a node), data-parallel groups of the ranks holding the same shard. ZeRO partitions and
    gradients are reduced over the data-parallel group; the grad norm is summed over the tensor group."""

    def __init__(self, tp: int):
        import torch.distributed as dist

        world, rank = dist.get_world_size(), dist.get_rank()
        self.tp, self.dp = tp, world // tp
        self.tp_rank, self.dp_rank = rank % tp, rank // tp
        self.tp_group = self.dp_group = None
        self.dp_ranks: list[int] = []
        # new_group is collective: every rank creates every group, in the same order.
        for start in range(0, world, tp):
            ranks = list(range(start, start + tp))
            group = dist.new_group(ranks)
            if rank in ranks:
                self.tp_group = group
        for offset in range(tp):
            ranks = list(range(offset, world, tp))
            group = dist.new_group(ranks)
            if rank in ranks:
                self.dp_group, self.dp_ranks = group, ranks

    def get_model_parallel_rank(self) -> int:
        return self.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.tp

    def get_model_parallel_group(self):
        return self.tp_group

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_data_parallel_rank(self) -> int:
        return self.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.dp

    def get_data_parallel_group(self):
        return self.dp_group

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.dp_ranks


split_dim = _split_dim  # the loader (harness/model/load) reads a shard's slice through the same table
