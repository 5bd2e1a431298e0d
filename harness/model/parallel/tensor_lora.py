"""LoRA on the harness's own tensor-parallel layers (parallel/tensor.py), split the Megatron way.

peft's tensor-parallel LoRA only accepts Megatron's layer classes, so the split projections get this one:
  column-parallel base (q/k/v, gate/up: this rank holds output rows)
      A whole (r x in), B split by rows (out/tp x r): y_r = W_r x + s B_r (A x).
      Each rank's dL/dA is only its B_r's share, so A's weight passes through Megatron's f (identity forward,
      all-reduce of its gradient in backward); the input gradient through A stays partial and the block's own
      f (the hook in tensor.py) sums it with the base's.
  row-parallel base (o, down: this rank holds input columns)
      A split by columns (r x in/tp), B whole (out x r): y = sum_r W_r x_r + s B (sum_r A_r x_r); the r-wide sum
      is Megatron's g (all-reduce forward, identity backward), B's gradient is then equal on every rank.
Split tensors carry tensor_model_parallel / partition_dim like the base shards, so DeepSpeed's grad norm counts
them on every rank and the replicated ones once. Module and parameter names are peft's
(<proj>.base_layer, <proj>.lora_A.default, <proj>.lora_B.default): checkpoints, merge_tensor and export read
one naming on every layout. Adapters start from adapters.init_a of the whole A (by HF name), then split, so a
tensor-parallel run starts from exactly the single-process peft model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from harness.model import adapters
from harness.model.parallel.tensor import COLUMN, ROW, RowParallelLinear, _CopyToGroup, _mark, _ReduceFromGroup


class TensorLoraLinear(nn.Module):
    """A split projection plus its LoRA (see the module docstring for which half is split)."""

    def __init__(self, base: nn.Linear, a_whole: torch.Tensor, scale: float, group, rank: int, size: int):
        super().__init__()
        self.base_layer, self.scaling, self.tp_group = base, scale, group
        self.row = isinstance(base, RowParallelLinear)
        r, dtype = a_whole.shape[0], base.weight.dtype
        a = a_whole.chunk(size, 1)[rank].clone() if self.row else a_whole.clone()
        out_features = base.out_features if self.row else base.weight.shape[0]
        self.lora_A = nn.ModuleDict({adapters.ADAPTER: nn.Linear(a.shape[1], r, bias=False, dtype=dtype)})
        self.lora_B = nn.ModuleDict({adapters.ADAPTER: nn.Linear(r, out_features, bias=False, dtype=dtype)})
        with torch.no_grad():
            self.lora_A[adapters.ADAPTER].weight.copy_(a)
            self.lora_B[adapters.ADAPTER].weight.zero_()
        if self.row:
            _mark(self.lora_A[adapters.ADAPTER].weight, 1)
        else:
            _mark(self.lora_B[adapters.ADAPTER].weight, 0)
        for p in base.parameters():
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.lora_A[adapters.ADAPTER].weight, self.lora_B[adapters.ADAPTER].weight
        if self.row:
            h = _ReduceFromGroup.apply(F.linear(x, a), self.tp_group)
        else:
            h = F.linear(x, _CopyToGroup.apply(a, self.tp_group))
        return self.base_layer(x) + F.linear(h, b) * self.scaling


def wrap_layer(layer: nn.Module, name: str, adapter: dict, seed: int, group, rank: int, size: int) -> None:
    """Give one split decoder layer (HF name `name`, e.g. model.layers.3) its LoRA on the targeted projections."""
    targets, scale = set(adapter["target_modules"]), adapters.scaling(adapter)
    for block_name, columns in COLUMN.items():
        block = getattr(layer, block_name)
        for proj in (*columns, ROW[block_name]):
            if proj not in targets:
                continue
            base = getattr(block, proj)
            in_whole = base.in_features * size if proj == ROW[block_name] else base.in_features
            a = adapters.init_a(seed, f"{name}.{block_name}.{proj}", adapter["r"], in_whole)
            setattr(block, proj, TensorLoraLinear(base, a, scale, group, rank, size))


def apply(named_layers, recipe: dict, group, rank: int, size: int) -> None:
    """LoRA on already-split decoder layers [(HF name, layer)]; everything else of the module is frozen by the
    caller (freeze_all_but_adapters)."""
    for name, layer in named_layers:
        wrap_layer(layer, name, recipe["adapter"], recipe["train"]["seed"], group, rank, size)


def freeze_all_but_adapters(module: nn.Module) -> None:
    for name, param in module.named_parameters():
        param.requires_grad_(adapters.is_trainable_name(name))
