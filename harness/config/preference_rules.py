"""Rules for preference objectives (train.objective dpo, ipo, simpo, orpo): the reference mode a run gets, and the
combinations refused before launch with the reason. Pure: reads the recipe and the DeepSpeed dict only (the
reference's architecture is compared in harness/train/checks.py, which reads its config.json).
"""

from __future__ import annotations

from harness.config.adapter_rules import lora_on
from harness.config.defaults import REFERENCE_FREE
from harness.config.objectives import family
from harness.config.layout_refusals import refused_layouts
from harness.config.resolve import Context
from harness.errors import Problem


def objective(recipe: dict) -> str:
    return recipe.get("train", {}).get("objective", "lm")


def is_preference(recipe: dict) -> bool:
    return family(recipe) == "preference"


def packing(recipe: dict) -> str:
    """train.packing as the attention choice sees it: a preference (or distillation) row is one sequence (prompt +
    completion, padding after it) with no position ids, which is concat (a plain causal mask; the padding is never a
    target)."""
    return "concat" if family(recipe) in ("preference", "distill") else recipe["train"]["packing"]


def reference_mode(recipe: dict) -> str | None:
    """precomputed, engine or adapter; None where the run has no reference (lm, simpo, orpo). auto: the adapters
    switched off under LoRA when no other reference is named (no second copy), else one pass up front."""
    if not is_preference(recipe) or objective(recipe) in REFERENCE_FREE:
        return None
    pref = recipe["preference"]
    if pref["reference_mode"] != "auto":
        return pref["reference_mode"]
    return "adapter" if lora_on(recipe) and pref["reference"] is None else "precomputed"


def check_preference(ds: dict, ctx: Context) -> list[Problem]:
    recipe = ctx.recipe
    if not is_preference(recipe):
        return []
    goal, pref, out = objective(recipe), recipe.get("preference", {}), []
    if goal in REFERENCE_FREE:
        if pref.get("reference_mode", "auto") != "auto":
            out.append(Problem("preference.reference_mode", f"reference_mode {pref['reference_mode']!r} with "
                               f"objective {goal}: {goal} has no reference model", "leave reference_mode at auto, "
                               "or use objective dpo / ipo"))
        if pref.get("reference") is not None:
            out.append(Problem("preference.reference", f"a reference model ({pref['reference']}) with objective "
                               f"{goal}: {goal} has no reference model", "drop preference.reference, or use dpo / ipo"))
    elif pref.get("reference_mode") == "adapter":
        if not lora_on(recipe):
            out.append(Problem("preference.reference_mode", "reference_mode adapter without LoRA: the reference is "
                               "the base with the adapters switched off, and there are none",
                               "set adapter.type=lora, or reference_mode precomputed / engine"))
        elif pref.get("reference") is not None:
            out.append(Problem("preference.reference", f"reference_mode adapter with a reference model "
                               f"({pref['reference']}): the adapter mode's reference is the policy's own base",
                               "drop preference.reference, or use reference_mode precomputed / engine"))
    return out + _layout_problems(ds, recipe, goal)


def _layout_problems(ds: dict, recipe: dict, goal: str) -> list[Problem]:
    """Layouts whose step does not run the pair's two rows through one forward of the whole model."""
    why = {"parallel.pipeline": "a pipeline's loss runs on its last stage per micro-batch of rows: a pair's "
                                "log-probs and the reference's would need a preference loss inside the pipe",
           "parallel.tensor": "the tensor-parallel head's logits are split by vocabulary; the pair log-probs need "
                              "the whole vocabulary's logsumexp",
           "parallel.sequence": "each rank holds a slice of every row: a pair's log-probs are a sum across the "
                                "sequence-parallel group"}
    return refused_layouts(ds, recipe, goal, why, ", or objective lm",
                           tiled="a preference loss needs each row's log-probs, computed row by row already (one "
                                 "row's fp32 logits at a time)", loss_name="the preference loss")
