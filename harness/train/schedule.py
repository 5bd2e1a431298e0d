"""The learning-rate schedule: which of DeepSpeed's scheduler values a step trains at, and what a resume does to it.

DeepSpeed's schedulers (runtime/lr_schedules.py) are functions of an iteration count that the engine advances
after every optimizer step. Built at iteration -1 they set the minimum lr, and their first step() gives iteration 0,
whose linear warmup value is still the minimum: left alone, step k trains at iteration k - 2 (two steps at lr 0
from warmup_min_lr 0, the peak one step late). The harness aligns the scheduler before the first step it trains:

    step k (1-based) trains at iteration k.

Linear warmup over W steps then gives step k the lr x k / W (step 1 the first nonzero value, step W the peak; HF's
get_linear_schedule_with_warmup trains step 1 at 0 and reaches the peak at step W + 1). The builder ends the decaying
schedules at train.steps + 1 (config/builder.schedule_total), so the last step trains above WarmupDecayLR's 0.

A resume aligns the same way from the checkpoint's step, after the checkpoint is loaded: the optimizer's param-group
lr it restores is the saving run's, and the scheduler would only overwrite it after the first resumed step. So the
first resumed step trains at the schedule of the run being launched (a longer train.steps, another lr or warmup),
and the start-up lines say when that schedule differs from the checkpoint's (its manifest's `scheduler`).
"""

from __future__ import annotations


def group_lrs(engine) -> list[float]:
    """The param groups' lrs as floats (torchao's _AdamW keeps each as a 0-d tensor: optimizer.stochastic_rounding)."""
    return [float(group["lr"]) for group in engine.optimizer.param_groups]


def set_lr(group: dict, lr: float) -> None:
    """Write a param group's lr as DeepSpeed's lr_schedules.update_lr does: in place where it is a tensor (torchao's
    _AdamW refuses a step whose lr was replaced by a float)."""
    if hasattr(group["lr"], "fill_"):
        group["lr"].fill_(lr)
    else:
        group["lr"] = lr


def align(engine, step0: int, launched_lrs: list[float] | None = None) -> list[float]:
    """Set the engine's scheduler so that step step0 + 1 trains at iteration step0 + 1 (DeepSpeed's step() writes
    the param groups' lr); without a scheduler (a constant lr) put back `launched_lrs`, the groups' lrs as this
    launch built them (a loaded checkpoint restores the saving run's). The lrs step step0 + 1 trains at."""
    scheduler = getattr(engine, "lr_scheduler", None)
    if scheduler is not None:
        scheduler.step(step0 + 1)  # every DeepSpeed scheduler's step takes the iteration as its first argument
    elif launched_lrs is not None:
        for group, lr in zip(engine.optimizer.param_groups, launched_lrs):
            set_lr(group, lr)
    return group_lrs(engine)


def lrs_at(block: dict, base_lrs: list[float], iterations) -> list[list[float]]:
    """The lrs DeepSpeed's scheduler of `block` ({"type", "params"}) gives at each iteration, on an optimizer whose
    groups start at `base_lrs` (WarmupCosineLR scales those): the real scheduler objects, no copy of their math."""
    import torch
    from deepspeed.runtime import lr_schedules

    params = [torch.nn.Parameter(torch.zeros(1)) for _ in base_lrs]
    optimizer = torch.optim.SGD([{"params": [p], "lr": lr} for p, lr in zip(params, base_lrs)], lr=base_lrs[0])
    scheduler = getattr(lr_schedules, block["type"])(optimizer, **block.get("params", {}))
    out = []
    for iteration in iterations:
        scheduler.step(iteration)
        out.append([group["lr"] for group in optimizer.param_groups])
    return out


def differs(saved: dict | None, here: dict) -> str | None:
    """What changed between the checkpoint's schedule (its manifest's, checkpoint/save.schedule_of) and this
    launch's, as 'key a -> b' parts; None when nothing did, or the checkpoint predates the manifest's record of it."""
    if saved is None:
        return None
    parts = [f"{k} {saved.get(k)} -> {here.get(k)}" for k in sorted(set(saved) | set(here))
             if saved.get(k) != here.get(k)]
    return ", ".join(parts) or None


def resume_line(tag: str, saved: dict | None, here: dict, step: int, lrs: list[float]) -> str | None:
    """The start-up line of a resume whose schedule is not the checkpoint's (None when it is)."""
    change = differs(saved, here)
    if change is None:
        return None
    return (f"schedule differs from {tag}'s ({change}): steps {step + 1} on follow this launch's, step {step + 1} "
            f"at lr {lrs[0]:.4g}")
