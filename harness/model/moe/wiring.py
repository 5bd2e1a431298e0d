"""What a MoE run adds to the DeepSpeed config and to the model before deepspeed.initialize.

- zero_optimization.leaf_module: under ZeRO-3 the family's MoE block is one leaf (its experts gathered together at
  block entry; a rank whose tokens skip an expert then still joins every gather), from config/moe_families.py,
  unless the config names its own leaves.
- expert_parallel: the recipe's parallel.expert emits {enabled, autoep_size} (config/builder.py); here the family's
  AutoEP preset and use_grouped_mm (grouped GEMMs on CUDA, DeepSpeed's loop over local experts on CPU, as
  DeepSpeed's own CPU tests run it) are filled in, unless already set.
- the router: moe.aux_loss / moe.aux_loss_coef set output_router_logits=True and the coefficient on the model.
"""

from __future__ import annotations

import copy

from harness.config import moe_families


def aux_on(recipe: dict) -> bool:
    moe = recipe.get("moe", {})
    return bool(moe.get("aux_loss")) or moe.get("aux_loss_coef") is not None


def ep_size(ds: dict) -> int:
    block = ds.get("expert_parallel") or {}
    return int(block.get("autoep_size", 1)) if block.get("enabled") else 1


def engine_blocks(ds: dict, model_config, cuda: bool) -> dict:
    """The DeepSpeed config with the MoE family's leaves (ZeRO-3) and AutoEP preset (EP) filled in."""
    family = moe_families.family_of(model_config)
    if family is None:
        return ds
    out = copy.deepcopy(ds)
    zero = out.setdefault("zero_optimization", {})
    if zero.get("stage") == 3 and "leaf_module" not in zero:
        zero["leaf_module"] = moe_families.leaf_module(family)
    block = out.get("expert_parallel")
    if block and block.get("enabled"):
        block.setdefault("preset_model", family.autoep_preset)
        block.setdefault("use_grouped_mm", cuda)
    return out


def prepare_model(model, recipe: dict, ds: dict) -> str | None:
    """Set the router's loss on the HF model (before deepspeed.initialize) and make transformers' output-capture
    registry take AutoEP's call (compat.py) when EP is on. Returns a line for the run log, or None (dense model)."""
    family = moe_families.family_of(getattr(model, "config", None))
    if family is None:
        return None
    if ep_size(ds) > 1 or (ds.get("expert_parallel") or {}).get("enabled"):
        from harness.model.moe.compat import patch_output_capture_registry

        patch_output_capture_registry()
    parts = [f"{family.name}: {moe_families.num_experts(family, model.config)} experts, top "
             f"{moe_families.field(model.config, family.top_k_attr)}"]
    if aux_on(recipe):
        coef = recipe["moe"].get("aux_loss_coef")
        coef = moe_families.aux_coef(model.config) if coef is None else float(coef)
        model.config.output_router_logits = True
        model.router_aux_loss_coef = coef
        parts.append(f"balancing loss on (coef {coef:g}, each rank's own micro-batch)")
    else:
        model.config.output_router_logits = False
        parts.append("balancing loss off (moe.aux_loss=true turns it on)")
    if family.bias_balanced:
        parts.append("routing bias e_score_correction_bias stays frozen (HF training never updates it)")
    return "; ".join(parts)
