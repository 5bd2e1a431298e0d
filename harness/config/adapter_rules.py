"""Rules for the recipe's `adapter` block (LoRA): combinations that cannot work, or are not implemented, are
refused before launch with the reason. Pure: reads the recipe and the DeepSpeed dict only.
"""

from __future__ import annotations

from harness.errors import Problem
from harness.config.resolve import Context, degrees

# The harness's own tensor-parallel layers (model/parallel/tensor.py): the projections a TP LoRA can wrap.
TP_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GPT2_PROJECTIONS = ("c_attn", "c_proj", "c_fc")  # in the default list; tensor parallel never meets GPT-2


def lora_on(recipe: dict) -> bool:
    return recipe.get("adapter", {}).get("type", "none") == "lora"


def check_adapter(ds: dict, ctx: Context) -> list[Problem]:
    adapter = ctx.recipe.get("adapter", {})
    if not lora_on(ctx.recipe):
        return []
    pp, tp = degrees(ds, ctx.recipe)
    out = []
    layout = "tensor parallel" if tp > 1 else "a pipeline" if pp > 1 else None
    if layout and adapter.get("use_dora"):
        out.append(Problem("adapter.use_dora", f"DoRA with {layout} (pipeline {pp}, tensor {tp}) is not "
                           "implemented: its magnitude vector needs the whole weight's column norms",
                           "use plain LoRA (adapter.use_dora=false), or a ZeRO recipe"))
    if layout and adapter.get("modules_to_save"):
        out.append(Problem("adapter.modules_to_save", f"modules_to_save {adapter['modules_to_save']} with {layout} "
                           f"(pipeline {pp}, tensor {tp}) is not implemented (embedding and head live in the "
                           "pipe's own wrappers, tied across stages)", "leave modules_to_save empty, or use a ZeRO recipe"))
    if tp > 1 and adapter.get("dropout"):
        out.append(Problem("adapter.dropout", f"LoRA dropout {adapter['dropout']} with tensor parallel {tp} is not "
                           "implemented: each rank of a tensor group would draw its own mask on the shared input",
                           "set adapter.dropout=0 with tensor parallel"))
    if tp > 1:
        outside = [m for m in adapter.get("target_modules", []) if m not in TP_PROJECTIONS + GPT2_PROJECTIONS]
        if outside:
            out.append(Problem("adapter.target_modules", f"{outside} with tensor parallel {tp}: the tensor-parallel "
                               f"LoRA wraps only the split projections ({', '.join(TP_PROJECTIONS)})",
                               "target those projections only"))
    out += _expert_lora(adapter, layout, pp, tp, ctx.recipe.get("parallel", {}).get("expert", 1))
    if adapter.get("load_in_4bit"):
        if layout:
            out.append(Problem("adapter.load_in_4bit", f"a 4-bit (QLoRA) base with {layout} (pipeline {pp}, tensor "
                               f"{tp}) is not implemented", "use QLoRA with a ZeRO-0..3 recipe"))
        if ctx.recipe.get("precision") == "fp32":
            out.append(Problem("adapter.load_in_4bit", "a 4-bit base computes in bf16 or fp16, not fp32",
                               "set precision to bf16 (or fp16)"))
    return out


def _expert_lora(adapter: dict, layout: str | None, pp: int, tp: int, ep: int) -> list[Problem]:
    """LoRA on fused expert tensors (adapter.target_parameters) is peft's ParamWrapper: no dropout, no DoRA, and
    none of the harness's tensor-parallel or pipeline LoRA paths."""
    params = adapter.get("target_parameters") or []
    if not params:
        return []
    out = []
    if adapter.get("dropout"):
        out.append(Problem("adapter.dropout", f"LoRA dropout {adapter['dropout']} with target_parameters {params}: "
                           "peft's parameter LoRA cannot apply dropout (the update is folded into the weight, so "
                           "the input is never seen apart)", "set adapter.dropout=0"))
    if adapter.get("use_dora"):
        out.append(Problem("adapter.use_dora", f"DoRA with target_parameters {params}: peft's parameter LoRA has "
                           "no DoRA", "set adapter.use_dora=false, or drop target_parameters"))
    if layout:
        out.append(Problem("adapter.target_parameters", f"target_parameters {params} with {layout} (pipeline {pp}, "
                           f"tensor {tp}) is not implemented", "use a ZeRO recipe for LoRA on experts"))
    if ep > 1:
        out.append(Problem("adapter.target_parameters", f"target_parameters {params} with parallel.expert={ep}: "
                           "DeepSpeed AutoEP replaces the fused expert tensors the adapters wrap with its own grouped "
                           "experts", "set parallel.expert=1 (ZeRO-3, whose MoE block is a leaf, or ZeRO-1/2), or "
                           "keep LoRA off the experts (target_modules only)"))
    return out
