"""optimizer.stochastic_rounding: torchao 0.18's `_AdamW(bf16_stochastic_round=True)` as DeepSpeed's client
optimizer (docs/optimizers.md). ZeRO-1/2/3 hands it the rank's flat bf16 master partition; it keeps exp_avg and
exp_avg_sq in that dtype (the bytes of bf16 master + states, no fp32 copy anywhere: the planner prices it as
optimizer.master_dtype / state_dtype bf16), computes each update in fp32 and rounds it into the bf16 partition
stochastically: up with the probability of the dropped 16 bits, from torch.randint on the partition's device, so
from torch's CPU generator (CUDA's on a GPU), which the harness saves per rank in every checkpoint (an exact resume).
DeepSpeed's scheduler writes the lr into torchao's tensor lr (lr_schedules.update_lr fills it in place).
The rules (config/optimizer_rules.check_stochastic_rounding) have refused everything but AdamW on ZeRO-1/2/3 with
bf16 master and states, no offload and no pipeline, before this runs.
"""

from __future__ import annotations

import importlib.util

from harness.errors import Problem


def enabled(recipe: dict) -> bool:
    return recipe.get("optimizer", {}).get("stochastic_rounding") is True


def problems(recipe: dict) -> list[Problem]:
    """Before any rank trains: torchao is an extra (setup.cfg lowbit)."""
    if enabled(recipe) and importlib.util.find_spec("torchao") is None:
        return [Problem("optimizer.stochastic_rounding", "stochastic rounding is torchao's _AdamW, and torchao is "
                        "not installed", "pip install -e '.[lowbit]' (torchao 0.18), or "
                        "optimizer.stochastic_rounding false")]
    return []


def initialize_args(params, recipe: dict) -> dict:
    """deepspeed.initialize's optimizer arguments for `params` (adapters.param_groups: tensors, or LoRA+'s groups
    with their lr): {"optimizer": torchao's _AdamW with the recipe's AdamW hyper-parameters} under stochastic
    rounding, else {"model_parameters": params} (DeepSpeed builds the optimizer from its config)."""
    if not enabled(recipe):
        return {"model_parameters": params}
    from torchao.optim import _AdamW

    opt = recipe["optimizer"]
    return {"optimizer": _AdamW(params, lr=opt["lr"], betas=tuple(opt["betas"]), eps=opt["eps"],
                                weight_decay=opt["weight_decay"], bf16_stochastic_round=True)}


def eager_on_cpu(recipe: dict) -> str | None:
    """torchao torch.compile's its per-parameter step; inductor on CPU takes minutes to compile it, so on a CPU
    machine the step runs eagerly (the same arithmetic and the same random draws)."""
    import torch

    if not enabled(recipe) or torch.cuda.is_available():
        return None
    torch.compiler.set_stance("force_eager")  # torchao compiles with fullgraph=True: dynamo's off switch raises there
    return "optimizer: torchao _AdamW on CPU: torch.compile is off (its step runs eagerly; inductor on CPU takes " \
           "minutes)"
