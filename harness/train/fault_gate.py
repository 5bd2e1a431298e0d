"""The DeepSpeed side of numeric faults: look at this rank's gradients, and drop an update, on every optimizer.

The engine calls `optimizer.step()` once per optimizer step, at the gradient accumulation boundary, after every
micro-batch's backward and after the gradients were reduced over the data-parallel ranks (ZeRO-0 in its
backward epilogue, ZeRO-1/2/3 in their reduce epilogues). harness/train/faults.py wraps that call: before it
runs, the ranks agree on whether the step is faulty; a faulty step is dropped through the optimizer's own
overflow path, the one DeepSpeed takes for an fp16 loss-scale overflow: gradients and the optimizer's reduce
buffers are cleared, parameters and optimizer state (moments, step counts) are left as they were, and the engine
sees `optimizer.overflow`, so it counts the step in `engine.skipped_steps` and does not advance the LR scheduler.

Per optimizer (DeepSpeed 0.19.8):
  ZeRO-1/2 (DeepSpeedZeroOptimizer)  gradients: the reduced partition (averaged_gradients; with CPU offload the fp32
                                     partition's .grad); drop: its step with its overflow check forced true
  ZeRO-3 (..._Stage3)                gradients: grad_partitions_flat_buffer; drop: its step with the overflow check
                                     forced true (_loss_scale_update_and_overflow_cleanup clears the partitions)
  ZeRO-0 bf16 (BF16_Optimizer)       gradients: the fp32 gradient partitions; drop: what its step does on an
                                     invalid norm (clear the hp and lp gradients), without the norm's all-reduce
  anything else (ZeRO-0 fp32's torch optimizer, ZeRO-0 fp16)
                                     gradients: the module's .grad; drop: no step; the engine zeroes the gradients
With fp16 dynamic loss scaling a forced drop counts as an overflow for the scaler (the scale is lowered), as
DeepSpeed itself does when an fp16 step overflows.
"""

from __future__ import annotations

import math

import torch


def _kind(optimizer) -> str:
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3):
        return "zero3"
    if isinstance(optimizer, DeepSpeedZeroOptimizer):
        return "zero12"
    if isinstance(optimizer, BF16_Optimizer):
        return "bf16"
    return "plain"


def _flat(grads) -> list[torch.Tensor]:
    out = []
    for g in grads:
        if isinstance(g, (list, tuple)):
            out.extend(_flat(g))
        elif g is not None:
            out.append(g)
    return out


def local_grads(engine) -> list[torch.Tensor]:
    """This rank's gradients as the optimizer is about to use them (reduced; under ZeRO this rank's partition)."""
    opt, kind = engine.optimizer, _kind(engine.optimizer)
    if kind == "zero12":
        if opt.cpu_offload:
            return _flat(p.grad for p in opt.single_partition_of_fp32_groups)
        return _flat(opt.averaged_gradients.values())
    if kind == "zero3" and opt.grad_partitions_flat_buffer is not None:
        return [opt.grad_partitions_flat_buffer]
    if kind == "bf16":
        return _flat(opt.fp32_groups_gradient_flat_partition)
    return [p.grad for p in engine.module.parameters() if p.grad is not None]


def nonfinite(tensors: list[torch.Tensor], device) -> torch.Tensor:
    """1.0 when any element of `tensors` is inf or NaN, else 0.0: a float tensor on `device`, no host sync.
    One fused multi-tensor 1-norm per device and dtype (as clip_grad_norm_ groups them): a NaN or inf element makes
    its tensor's norm non-finite (the sum propagates both; overflowing past 3.4e38 means a non-finite norm anyway),
    so ZeRO-0's hundreds of gradients cost a few kernels, not three per tensor."""
    groups: dict = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    flags = [torch.zeros((), dtype=torch.float32, device=device)]
    for group in groups.values():
        norms = torch.stack(torch._foreach_norm(group, 1))
        flags.append((~torch.isfinite(norms)).any().to(device=device, dtype=torch.float32))
    return torch.stack(flags).max()


def drop_update(optimizer, original_step) -> None:
    """Run the optimizer's overflow path instead of its update (see the module docstring)."""
    kind = _kind(optimizer)
    if kind == "zero12":
        with _instance_attrs(optimizer, check_grad_overflow=True,
                             check_overflow=lambda partition_gradients=True: setattr(optimizer, "overflow", True)):
            original_step()
    elif kind == "zero3":
        def forced(update_scale=True):
            optimizer.overflow = True
            return True

        with _instance_attrs(optimizer, _overflow_check_and_loss_scale_update=forced):
            original_step()
    elif kind == "bf16":
        optimizer.overflow = True
        optimizer._global_grad_norm = math.inf
        optimizer.clear_hp_grads()
        optimizer.clear_lp_grads()
    else:  # the engine reads optimizer.overflow (hasattr) and zeroes the gradients after this
        optimizer.overflow = True
    if not optimizer.overflow:  # invariant: the engine must see the drop, or it steps the LR scheduler
        raise RuntimeError(f"numeric faults: {type(optimizer).__name__} did not take its overflow path")


def plain_step(optimizer, original_step):
    """A step that is kept. A plain torch optimizer gets `overflow` cleared (the engine reads it after every step
    once a drop has set it); DeepSpeed's optimizers set it themselves."""
    if _kind(optimizer) == "plain":
        optimizer.overflow = False
    return original_step()


class _instance_attrs:
    """Shadow attributes of one object for the duration of a call, then restore exactly what was there."""

    def __init__(self, obj, **attrs):
        self.obj, self.attrs = obj, attrs
        self.saved = {}

    def __enter__(self):
        for name, value in self.attrs.items():
            self.saved[name] = self.obj.__dict__.get(name, _MISSING)
            setattr(self.obj, name, value)

    def __exit__(self, *exc):
        for name, value in self.saved.items():
            if value is _MISSING:
                delattr(self.obj, name)
            else:
                setattr(self.obj, name, value)


_MISSING = object()
