"""optimizer.stochastic_rounding: torchao 0.18's `_AdamW(bf16_stochastic_round=True)` as DeepSpeed's client
optimizer (docs/optimizers.md). ZeRO-1/2/3 hands it the rank's flat bf16 master partition; it keeps exp_avg and
exp_avg_sq in that dtype (the bytes of bf16 master + states, no fp32 copy anywhere: the planner prices it as
optimizer.master_dtype / state_dtype bf16), computes each update in fp32 and rounds it into the bf16 partition
stochastically: up with the probability of the dropped 16 bits, from torch.randint on the partition's device, so
from torch's CPU generator (CUDA's on a GPU), which the harness saves per rank in every checkpoint (an exact resume).
DeepSpeed's scheduler writes the lr into torchao's tensor lr (lr_schedules.update_lr fills it in place).
On a CPU machine the step runs eagerly (eager_on_cpu) and in chunks (chunked_adamw): eagerly each fp32 intermediate
of the update is a tensor the size of the parameter, and ZeRO's parameter is the rank's whole flat partition (a
618M model on 2 ranks: ~8 GB of them at once, killed by the OOM killer; bench/optimizer_states.py).
The rules (config/optimizer_rules.check_stochastic_rounding) have refused everything but AdamW on ZeRO-1/2/3 with
bf16 master and states, no offload and no pipeline, before this runs.
"""

from __future__ import annotations

import importlib.util

from harness.errors import Problem

# Elements a chunk of the eager CPU step covers: its ~10 fp32/int32 temporaries then hold ~170 MB at most.
CPU_CHUNK_ELEMS = 1 << 22


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
    import torch
    from torchao.optim import _AdamW

    opt = recipe["optimizer"]
    cls = _AdamW if torch.cuda.is_available() else chunked_adamw()
    return {"optimizer": cls(params, lr=opt["lr"], betas=tuple(opt["betas"]), eps=opt["eps"],
                             weight_decay=opt["weight_decay"], bf16_stochastic_round=True)}


def chunked_adamw(chunk_elems: int = CPU_CHUNK_ELEMS):
    """torchao's _AdamW whose step runs torchao's own single_param_adam on slices of at most `chunk_elems` of each
    contiguous parameter (views: the update lands in place) instead of once on the whole. The same arithmetic, and
    the same random bits: the CPU generator fills randint's slices in order, as it fills the whole tensor
    (tests/test_optimizers.py compares them bitwise). On a GPU torchao's compiled step fuses the intermediates away
    and is used as it is."""
    import torch
    from torchao.optim import _AdamW
    from torchao.optim.adam import single_param_adam

    class ChunkedAdamW(_AdamW):
        @torch.no_grad()
        def step(self, closure=None):
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    state = self.state[p]
                    if not state:  # as torchao's step initialises it
                        state.update(step=torch.tensor(0.0), exp_avg=self._new_buffer(p, True),
                                     exp_avg_sq=self._new_buffer(p, False))
                        if group["amsgrad"]:
                            state["max_exp_avg_sq"] = self._new_buffer(p, False)
                    state["step"] += 1
                    for part in _chunks(p.detach(), p.grad, state, chunk_elems):
                        single_param_adam(*part, group["lr"], group["betas"][0], group["betas"][1],
                                          group["weight_decay"], group["eps"], self.is_adamw,
                                          self.bf16_stochastic_round and p.dtype is torch.bfloat16)
            return loss

    return ChunkedAdamW


def _chunks(p, grad, state, chunk_elems: int):
    """(param, grad, step, exp_avg, exp_avg_sq, max_exp_avg_sq) slices of at most chunk_elems elements; the whole
    tensors when one is not contiguous or the parameter is no larger than a chunk."""
    tensors = [p, grad, state["exp_avg"], state["exp_avg_sq"], state.get("max_exp_avg_sq")]
    if p.numel() <= chunk_elems or not all(t is None or t.is_contiguous() for t in tensors):
        yield tensors[0], tensors[1], state["step"], *tensors[2:]
        return
    flat = [t if t is None else t.view(-1) for t in tensors]
    for start in range(0, p.numel(), chunk_elems):
        a, g, m, v, mx = (t if t is None else t[start:start + chunk_elems] for t in flat)
        yield a, g, state["step"], m, v, mx


def eager_on_cpu(recipe: dict) -> str | None:
    """torchao torch.compile's its per-parameter step; inductor on CPU takes minutes to compile it, so on a CPU
    machine the step runs eagerly (the same arithmetic and the same random draws), in chunks (chunked_adamw)."""
    import torch

    if not enabled(recipe) or torch.cuda.is_available():
        return None
    torch.compiler.set_stance("force_eager")  # torchao compiles with fullgraph=True: dynamo's off switch raises there
    return "optimizer: torchao _AdamW on CPU: torch.compile is off (its step runs eagerly, in chunks of " \
           f"{CPU_CHUNK_ELEMS:,} elements; inductor on CPU takes minutes)"
