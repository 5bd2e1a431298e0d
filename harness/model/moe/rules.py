"""MoE refusals, found before any rank trains (train/checks.py collects them; exit 2 with what, values and fix)."""

from __future__ import annotations

from harness.errors import Problem
from harness.model.moe import families
from harness.model.moe.wiring import aux_on


def problems(recipe: dict, world: int, model_config) -> list[Problem]:
    family = families.family_of(model_config)
    parallel = recipe["parallel"]
    ep, tp, pp = parallel.get("expert", 1), parallel["tensor"], parallel["pipeline"]
    model = recipe["train"]["model"]
    out: list[Problem] = []
    if family is None:
        kind = families.field(model_config, "model_type", "?")
        if ep > 1:
            out.append(Problem("parallel.expert", f"parallel.expert={ep} but {model} ({kind}) is not a Mixture-of-"
                               f"Experts model the harness knows ({families.known()})",
                               "set parallel.expert=1, or train one of those families"))
        if aux_on(recipe):
            out.append(Problem("moe.aux_loss", f"moe.aux_loss is on but {model} ({kind}) has no router and no "
                               "balancing loss", "remove moe.aux_loss / moe.aux_loss_coef"))
        return out
    if tp > 1:
        out.append(Problem("parallel.tensor", f"parallel.tensor={tp} with the MoE model {model} ({family.name}): the "
                           "harness's tensor parallel splits nn.Linear layers, not the fused 3D experts, and DeepSpeed "
                           "AutoEP refuses an mpu tensor-parallel group",
                           "set parallel.tensor=1 (use parallel.expert to split the experts, or ZeRO-3)"))
    if aux_on(recipe) and not family.aux_loss:
        out.append(Problem("moe.aux_loss", f"{model} ({family.name}) has no load-balancing loss: it balances with "
                           "a routing bias (e_score_correction_bias)", "remove moe.aux_loss / moe.aux_loss_coef"))
    if pp > 1 and (ep > 1 or aux_on(recipe)):
        what = "parallel.expert" if ep > 1 else "moe.aux_loss"
        out.append(Problem(what, f"{what} with parallel.pipeline={pp}: pipeline stages pass hidden states only, so "
                           "the router logits (and the aux loss of every stage) are dropped, and AutoEP is untested "
                           "under DeepSpeed's pipeline engine", "set parallel.pipeline=1 (ZeRO-3 or EP for MoE)"))
    if ep <= 1:
        return out
    experts = families.num_experts(family, model_config)
    if family.autoep_preset is None:
        out.append(Problem("parallel.expert", f"parallel.expert={ep}: DeepSpeed AutoEP has no preset for "
                           f"{family.name} ({family.note})", "set parallel.expert=1 and use ZeRO-3 (its MoE block "
                           "is a leaf) or ZeRO-1/2"))
    if experts % ep:
        out.append(Problem("parallel.expert", f"parallel.expert={ep} does not divide the {experts} experts of "
                           f"{model}: {experts} % {ep} = {experts % ep}",
                           f"use a divisor of {experts} (e.g. {max(d for d in range(1, ep) if experts % d == 0)})"))
    dp = world // max(tp * pp, 1)
    if world % ep or dp % ep:
        out.append(Problem("parallel.expert", f"parallel.expert={ep} does not divide the {dp} data-parallel ranks "
                           f"(world {world}): {dp} % {ep} = {dp % ep}; AutoEP groups expert ranks inside data "
                           "parallel", f"launch a multiple of {ep} ranks, or lower parallel.expert"))
    return out
