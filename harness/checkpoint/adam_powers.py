"""The state a checkpoint cannot hold: DeepSpeed's CPU Adam kernels keep beta1^t and beta2^t as running products.

DeepSpeed's C++ Adam (csrc/includes/cpu_adam.h, Adam_Optimizer::IncrementStep), behind DeepSpeedCPUAdam (optimizer
offload, on any machine) and FusedAdam on the CPU accelerator, computes the bias corrections from beta^t that it
updates in float: beta^t *= beta when a call's step is the last one + 1, else std::pow(beta, step). A process that
trained from step 1 holds the product of t roundings; a process that loaded step k from a checkpoint calls with
k + 1 first and gets pow(beta, k + 1), often 1 ulp away from the product (betas 0.9, 0.95: at 18 of the steps
6..24), so 1 - beta2^t, every update after the resume, and the weights differ in their last bits from the run
that was never stopped (issue #33 part 4). The products live in the kernel, per process, not in the optimizer's
state_dict; `rebuild` makes them again after a load by calling the kernel for steps 1..k on a one-element dummy
tensor, with each param group's betas, as the uninterrupted run did. The real tensors are not touched.

Checked on 2 CPU ranks (issue #33), resumed in another process: ZeRO-0 bf16, ZeRO-1 fp32, ZeRO-2 and ZeRO-3 fp32
and bf16, ZeRO-2 with CPU offload; with the rebuild every loss and checkpoint tensor is bit-equal to the
uninterrupted run's.

CUDA's FusedAdam computes pow(beta, step) at every step (no state), so there is nothing to rebuild on a GPU unless
the optimizer is offloaded to the CPU.
"""

from __future__ import annotations

import numpy as np
import torch

# Once beta^t is below this, float 1 - beta^t is exactly 1 whether beta^t came from the product or from pow
# (1 - x rounds to 1 for x <= 2^-25); the replay stops there and the kernel jumps to step k by pow.
NEGLIGIBLE = 2.0 ** -30


def base_optimizer(engine):
    """The torch optimizer under DeepSpeed's wrappers (ZeRO, bf16, fp16: each holds it as .optimizer), or None."""
    opt = getattr(engine, "optimizer", None)
    for _ in range(4):
        if opt is None or isinstance(opt, torch.optim.Optimizer):
            return opt
        opt = getattr(opt, "optimizer", None)
    return None


def _kernel(opt):
    """A function(step, group) calling `opt`'s stateful C++ Adam kernel on a dummy tensor; None when its kernel
    keeps no running products (CUDA FusedAdam, torch's Adam, SGD, ...)."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    dummy = [torch.zeros(1, dtype=torch.float32) for _ in range(4)]  # param, grad, exp_avg, exp_avg_sq
    if isinstance(opt, DeepSpeedCPUAdam):
        return lambda step, g: opt.ds_opt_adam.adam_update(opt.opt_id, step, g["lr"], *g["betas"], g["eps"],
                                                           g["weight_decay"], g["bias_correction"], *dummy)
    if isinstance(opt, FusedAdam) and get_accelerator().device_name() == "cpu":
        from deepspeed.ops.adam.fused_adam import multi_tensor_applier

        lists = [[dummy[1]], [dummy[0]], [dummy[2]], [dummy[3]]]  # the kernel's order: grads, params, m, v
        return lambda step, g: multi_tensor_applier(opt.multi_tensor_adam, opt._dummy_overflow_buf, lists, g["lr"],
                                                    *g["betas"], g["eps"], step, opt.adam_w_mode,
                                                    1 if g["bias_correction"] else 0, g["weight_decay"])
    return None


def loaded_step(opt) -> int:
    """The optimizer steps the loaded state has taken (0: no optimizer state was loaded)."""
    steps = [state["step"] for state in opt.state.values() if isinstance(state, dict) and "step" in state]
    steps += [group["step"] for group in opt.param_groups if "step" in group]  # FusedAdam's older layout
    return max((int(s) for s in steps), default=0)


def _settled(betas: list[tuple[float, float]], powers: np.ndarray) -> bool:
    """Every running product is negligible, or exact whatever the path (beta 0 or 1)."""
    return all(p < NEGLIGIBLE or b in (0.0, 1.0) for p, b in zip(powers, np.ravel(betas)))


@torch.no_grad()
def rebuild(opt) -> int:
    """After `opt` (base_optimizer(engine)) loaded its state, put its Adam kernel's running beta powers where an
    uninterrupted run has them. Every rank: each process has its own kernel. Returns the steps replayed."""
    call = _kernel(opt) if opt is not None else None
    if call is None or not loaded_step(opt):
        return 0
    steps = loaded_step(opt)
    # ZeRO-3 puts each sub-group's partition into its param group only while it steps: then every group counts
    groups = [g for g in opt.param_groups if g["params"]] or opt.param_groups
    betas = [tuple(g["betas"]) for g in groups]
    powers = np.ones(2 * len(groups), dtype=np.float32)
    factors = np.asarray(np.ravel(betas), dtype=np.float32)
    for step in range(1, steps + 1):
        for group in groups:  # as the optimizer's step calls it: each group in order, the same step
            call(step, group)
        powers = powers * factors  # float32, as the kernel multiplies
        if step < steps and _settled(betas, powers):
            for group in groups:  # the rest changes no bias correction: jump to the loaded step (pow)
                call(steps, group)
            return step
    return steps
