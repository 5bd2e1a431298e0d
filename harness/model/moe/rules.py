"""MoE refusals, found before any rank trains (train/checks.py collects them; exit 2 with what, values and fix)."""

from __future__ import annotations

from harness.errors import Problem
from harness.config import moe_families
from harness.model.moe.wiring import aux_on


def problems(recipe: dict, world: int, model_config) -> list[Problem]:
    family = moe_families.family_of(model_config)
    parallel = recipe["parallel"]
    ep, tp, pp = parallel["expert"], parallel["tensor"], parallel["pipeline"]
    model = recipe["train"]["model"]
    out: list[Problem] = []
    if family is None:
        kind = moe_families.field(model_config, "model_type", "?")
        if ep > 1:
            out.append(Problem("parallel.expert", f"parallel.expert={ep} but {model} ({kind}) is not a Mixture-of-"
                               f"Experts model the harness knows ({moe_families.known()})",
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
    sp, train = parallel["sequence"], recipe["train"]
    if sp > 1 or train["tiled_loss"] or train["tiled_mlp"]:
        key = "parallel.sequence" if sp > 1 else ("train.tiled_loss" if train["tiled_loss"] else "train.tiled_mlp")
        out.append(Problem(key, f"{key}={sp if sp > 1 else True} with the MoE model {model} "
                           f"({family.name}): the long-context path (harness/model/sequence) computes the LM loss "
                           "from hidden states and tiles dense MLPs, so the router's balancing loss and the fused "
                           "experts are not wired there (untested), and DeepSpeed AutoEP refuses sequence parallelism"
                           " under ZeRO-3", "set parallel.sequence=1 and train.tiled_loss/tiled_mlp=false for MoE "
                           "models (ZeRO-3 with leaves or parallel.expert, with activation_checkpointing for long "
                           "rows)"))
    if pp > 1:
        out.append(Problem("parallel.pipeline", f"parallel.pipeline={pp} with the MoE model {model} "
                           f"({family.name}): pipeline stages pass hidden states only, so the router logits (the aux "
                           "loss of every stage) would be dropped; AutoEP is untested under "
                           "DeepSpeed's pipeline engine", "set parallel.pipeline=1 (ZeRO-3 with leaves, or "
                           "parallel.expert)"))
    if ep <= 1:
        return out
    experts = moe_families.num_experts(family, model_config)
    if family.autoep_preset is None:
        out.append(Problem("parallel.expert", f"parallel.expert={ep}: DeepSpeed AutoEP has no preset for "
                           f"{family.name} ({family.note})", "set parallel.expert=1 and use ZeRO-3 (its MoE block "
                           "is a leaf) or ZeRO-1/2"))
    if aux_on(recipe) and not family.ep_router_logits:  # measured: HF's load_balancing_loss_func gets no logits
        out.append(Problem("moe.aux_loss", f"moe.aux_loss with parallel.expert={ep} on {family.name}: {family.note}",
                           "set moe.aux_loss=false with parallel.expert, or parallel.expert=1 (ZeRO-3 with leaves)"))
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
