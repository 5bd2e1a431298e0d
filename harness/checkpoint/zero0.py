"""ZeRO-0 on either side of a layout change (a pipeline or ZeRO-2 run resumed as plain data parallel, and back).

DeepSpeed's universal checkpoint neither reads nor writes ZeRO-0's optimizer state: ds_to_universal wants ZeRO
optimizer files, and a ZeRO-0 engine with checkpoint.load_universal loads no optimizer state from it. Yet the
universal folder holds, per parameter under its HF name, the fp32 weight and the Adam moments and step
(zero/NAME/{fp32,exp_avg,exp_avg_sq,step}.pt), which is all an unsharded Adam needs. So:
  save    a ZeRO-0 save records its optimizer's parameter names per group (client state NAMES): DeepSpeed stores the
          torch optimizer's state by index only;
  to      `to_universal` writes that folder from a ZeRO-0 save (rank 0, in resume.universal's conversion), in the
          form ZeRO-1/2/3 engines read after relayout.for_every_stage;
  from    `load_universal` fills a ZeRO-0 engine from it: each parameter's fp32 weight, and the optimizer's state
          through its own load_state_dict (so its step and tensors take the types it uses).
Built for fp32 training without tensor or pipeline parallelism on the ZeRO-0 side (resume.needs_universal refuses the
rest before any rank starts): bf16 ZeRO-0 keeps fp32 masters inside DeepSpeed's wrapper, and a tensor- or pipeline-
parallel ZeRO-0 save splits its optimizer state over files this module does not join.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from harness.checkpoint.expert_layout import load_converted

NAMES = "zero0_param_names"  # client state of a ZeRO-0 save: [[parameter name, ...] per optimizer group]
MOMENTS = ("exp_avg", "exp_avg_sq")
MODEL_STATES = "mp_rank_00_model_states.pt"
# the model-states keys DeepSpeed's own load consumes; the rest is the client state (engine.load_checkpoint's answer)
DEEPSPEED_KEYS = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
                  "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
                  "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config",
                  "ds_version", "universal_checkpoint_info", "checkpoint_parallel_dimensions", NAMES}


def param_names(engine) -> list[list[str]] | None:
    """The optimizer's parameter names per group; None where its groups hold other tensors than the module's (bf16:
    DeepSpeed's wrapper steps fp32 masters), a layout change this module refuses (see above)."""
    names = {id(p): n for n, p in engine.module.named_parameters()}
    groups = [group["params"] for group in engine.optimizer.param_groups]
    if not all(id(p) in names for params in groups for p in params):
        return None
    return [[names[id(p)] for p in params] for params in groups]


def to_universal(source: Path, out: Path) -> None:
    """The universal folder (zero/NAME/*.pt, zero/optimizer_state.pt, the model states) of ZeRO-0 save `source`,
    written into `out`."""
    from deepspeed.checkpoint.constants import CAT_DIM, PARAM, PARAM_GROUPS

    from harness.model.parallel.tensor import split_dim

    states = load_converted(source / MODEL_STATES)
    names, optim = states.get(NAMES), states["optimizer"]
    if names is None:
        raise RuntimeError(f"{source}: a ZeRO-0 save without {NAMES} (written before the harness recorded them)")
    for group, group_names in zip(optim[PARAM_GROUPS], names):
        step = group_step(group, optim["state"])
        for index, name in zip(group["params"], group_names):
            weight = states["module"][name].float()
            state = optim["state"].get(index, {})
            folder = out / "zero" / name
            folder.mkdir(parents=True)
            torch.save({PARAM: weight, CAT_DIM: split_dim(name) or 0}, folder / "fp32.pt")
            for key in MOMENTS:
                moment = state.get(key, torch.zeros_like(weight)).float()
                torch.save({PARAM: moment, CAT_DIM: split_dim(name) or 0}, folder / f"{key}.pt")
            torch.save(step, folder / "step.pt")
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optim[PARAM_GROUPS]]
    torch.save({PARAM_GROUPS: groups}, out / "zero" / "optimizer_state.pt")
    os.link(source / MODEL_STATES, out / MODEL_STATES)  # the client state, the lr scheduler, ds_version


def group_step(group: dict, states: dict) -> int:
    """The Adam step of an optimizer group: the largest of its parameters'. DeepSpeed's FusedAdam (ZeRO-0's
    optimizer) adds 1 to the state of the LAST parameter of a group only and takes that count for all of them
    (ops/adam/fused_adam.py: `state['step'] += 1` after its loop), so the others keep the step they started at."""
    steps = [_step(states[i]["step"]) for i in group["params"] if "step" in states.get(i, {})]
    return max(steps, default=_step(group.get("step", 0)))


def _step(step) -> int:
    return int(step.item() if torch.is_tensor(step) else step)


@torch.no_grad()
def load_universal(engine, folder: Path) -> dict:
    """Fill ZeRO-0 `engine` from universal `folder`; returns the client state (step, epoch, ...)."""
    from deepspeed.checkpoint.constants import PARAM

    optimizer, zero = engine.optimizer, folder / "zero"
    state, step = {}, 0
    flat = [p for group in optimizer.param_groups for p in group["params"]]
    names = {id(p): n for n, p in engine.module.named_parameters()}
    for index, param in enumerate(flat):
        source = zero / names[id(param)]
        param.copy_(load_converted(source / "fp32.pt")[PARAM].view_as(param))
        step = _step(load_converted(source / "step.pt"))
        state[index] = {"step": _as_optimizer_step(optimizer, step),
                        **{k: load_converted(source / f"{k}.pt")[PARAM].view_as(param).to(param)
                           for k in MOMENTS}}
    for name, param in engine.module.named_parameters():  # frozen ones (LoRA's base) come from the build
        if param.requires_grad and id(param) not in {id(p) for p in flat}:
            raise RuntimeError(f"{name} trains but is in no optimizer group")
    groups = optimizer.state_dict()["param_groups"]
    for group in groups:
        group["step"] = step  # DeepSpeed's FusedAdam starts a parameter's state from its group's step
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    states = load_converted(folder / MODEL_STATES)
    if engine.lr_scheduler is not None and states.get("lr_scheduler"):
        engine.lr_scheduler.load_state_dict(states["lr_scheduler"])
    engine.global_steps = states.get("global_steps", engine.global_steps)
    engine.global_samples = states.get("global_samples", engine.global_samples)
    return {k: v for k, v in states.items() if k not in DEEPSPEED_KEYS}


def _as_optimizer_step(optimizer, step: int):
    """torch's Adam/AdamW keep the step as a float tensor; DeepSpeed's FusedAdam and CPU Adam as an int."""
    return torch.tensor(float(step)) if type(optimizer).__module__.startswith("torch.optim") else step
