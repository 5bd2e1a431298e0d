"""What a ZeRO-0 fp32 step lacks from DeepSpeed 0.19.8 (the global gradient norm) and what it wastes (an all-reduce
over a world of one rank).

`engine.get_global_grad_norm()` returns the optimizer's `_global_grad_norm`, read after every optimizer step. ZeRO-1/2/3
and ZeRO-0's bf16 and fp16 wrappers set it; ZeRO-0 fp32 steps the plain torch optimizer, which has none, so the
engine reports None. (With gradient_clipping > 0 the engine does compute a norm to clip by, in
runtime.utils.clip_grad_norm_, but returns nothing, and that norm accumulates in float32: on CPU it is off by ~1e-6
relative on the tiny test model, where ZeRO-1/2/3 accumulate in float64, get_norm_dtype.)

`install` measures the norm as ZeRO-1/2/3 do, at the one point where the gradients are final and not yet clipped:
after ZeRO-0 averaged them over the data-parallel ranks (its backward epilogue) and before the engine's clip
(clipping > 0: engine.clip_fp32_gradients, left as it is) or the optimizer's step (clipping 0). The measure is one
fused multi-tensor 2-norm per device and dtype, accumulated in float64 (torch._foreach_norm(dtype=)), then the
2-norm of those norms: a few kernels, no copies, and no collective, since after the average every data-parallel
rank holds the same gradients. With a model-parallel unit (tensor or pipeline parallel: a rank holds a shard) or
MoE experts, DeepSpeed's clip_grad_norm_ at an infinite bound measures it, summing over the model-parallel group
as it does when clipping. The value is the L2 norm of the averaged gradients before clipping: ZeRO-1/2/3's value.

On a world of one rank ZeRO-0's backward epilogue still "averages" the gradients: it flattens them into buckets,
all-reduces each over the one rank, divides by 1 and copies them back (~4 % of a GRPO step of the tiny model on one
CPU rank, bench/rl.py). `skip_lone_allreduce` turns that off (the engine's own switch, enable_backward_allreduce)
where it changes nothing: ZeRO-0, a plain optimizer, one process, no model-parallel unit, no MoE.
"""

from __future__ import annotations

import math

import torch


def install(engine) -> bool:
    """Both, where they apply. True when the optimizer had no norm of its own (ZeRO-0 fp32)."""
    if not _plain_zero0(engine):
        return False
    skip_lone_allreduce(engine)
    install_grad_norm(engine)
    return True


def _plain_zero0(engine) -> bool:
    optimizer = getattr(engine, "optimizer", None)
    return optimizer is not None and engine.zero_optimization_stage() == 0 and \
        not hasattr(optimizer, "_global_grad_norm")


def skip_lone_allreduce(engine) -> None:
    import torch.distributed as tdist

    world = tdist.get_world_size() if tdist.is_initialized() else 1
    if world == 1 and getattr(engine, "mpu", None) is None and not getattr(engine, "has_moe_layers", False) \
            and not engine.pipeline_parallelism:
        engine.enable_backward_allreduce = False


def install_grad_norm(engine) -> None:
    optimizer = engine.optimizer
    optimizer._global_grad_norm = None  # the engine copies it after every step (engine._take_model_step)
    owner, name = (engine, "clip_fp32_gradients") if engine.gradient_clipping() > 0 else (optimizer, "step")
    original = getattr(owner, name)

    def measured(*args, **kwargs):
        optimizer._global_grad_norm = global_norm(engine)
        return original(*args, **kwargs)

    setattr(owner, name, measured)


def global_norm(engine) -> torch.Tensor:
    """The L2 norm of the engine's (averaged, unclipped) gradients: a 0-d tensor, read without a host sync."""
    params = [p for p in engine.module.parameters() if p.grad is not None]
    if getattr(engine, "mpu", None) is not None or getattr(engine, "has_moe_layers", False):
        from deepspeed.runtime.utils import clip_grad_norm_

        return clip_grad_norm_(params, max_norm=math.inf, mpu=engine.mpu).detach().reshape(())
    from deepspeed.runtime.zero.utils import get_norm_dtype

    groups: dict = {}
    for g in (p.grad for p in params):
        groups.setdefault((g.device, g.dtype), []).append(g)
    if not groups:
        return torch.zeros((), dtype=torch.float32, device=engine.device)
    wide = get_norm_dtype()
    norms = [torch.stack(torch._foreach_norm(g, 2, dtype=wide)).to(engine.device) for g in groups.values()]
    return torch.linalg.vector_norm(torch.cat(norms))
