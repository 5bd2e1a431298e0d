"""Rules for knowledge distillation (train.objective gkd, distill; the distill block): each key's value as TRL 1.16
gives it (a null takes the objective's own default: GKDConfig's for gkd, DistillationConfig's for distill), the
teacher mode a run gets, and what is refused before launch with the reason. Pure: the recipe and the DeepSpeed
dict only; the teacher's vocabulary and tokenizer are compared in harness/train/checks.py (its files).
"""

from __future__ import annotations

from harness.config.adapter_rules import lora_on
from harness.config.distill_topk_rules import topk_problems
from harness.config.objectives import family
from harness.config.layout_refusals import refused_layouts
from harness.config.resolve import Context
from harness.errors import Problem

# TRL 1.16's defaults of the keys the two configs name differently or default differently; loss_temperature None:
# gkd's loss runs at T = 1 whatever `temperature` says (GKDTrainer.compute_loss calls generalized_jsd_loss without
# it), distill's at `temperature` (DistillationTrainer passes it to the loss)
TRL_DEFAULTS = {
    "gkd": {"beta": 0.5, "lmbda": 0.5, "temperature": 0.9, "loss_temperature": 1.0, "max_new_tokens": 128,
            "max_completion_length": None, "disable_dropout": True},
    "distill": {"beta": 1.0, "lmbda": 1.0, "temperature": 1.0, "loss_temperature": None, "max_new_tokens": None,
                "max_completion_length": 512, "disable_dropout": False},
}


def is_distill(recipe: dict) -> bool:
    return family(recipe) == "distill"


def settings(recipe: dict) -> dict:
    """The distill block with every null replaced by the objective's TRL default; loss_temperature resolved (gkd:
    1.0, TRL's quirk; distill: its temperature)."""
    goal = recipe["train"]["objective"]
    block = dict(recipe.get("distill", {}))
    for key, value in TRL_DEFAULTS[goal].items():
        if block.get(key) is None:
            block[key] = value
    if block["loss_temperature"] is None:
        block["loss_temperature"] = block["temperature"]
    return block


def teacher_mode(recipe: dict) -> str | None:
    """engine, adapter, precomputed or served (None: not a distillation run). auto: served when a teacher server is
    named, the adapters off under LoRA when no teacher is named (self-distillation, no second copy), else a frozen
    engine."""
    if not is_distill(recipe):
        return None
    block = recipe["distill"]
    if block["teacher_mode"] != "auto":
        return block["teacher_mode"]
    if block.get("teacher_model_server_url"):
        return "served"
    return "adapter" if lora_on(recipe) and block["teacher_model_name_or_path"] is None else "engine"


def on_policy(recipe: dict) -> bool:
    """Whether some completions are generated during training (lmbda > 0, seq_kd, or objective distill)."""
    s = settings(recipe)
    return recipe["train"]["objective"] == "distill" or s["lmbda"] > 0 or bool(s["seq_kd"])


def check_distill(ds: dict, ctx: Context) -> list[Problem]:
    recipe = ctx.recipe
    if not is_distill(recipe):
        return []
    goal, block = recipe["train"]["objective"], recipe.get("distill", {})
    out = [Problem(f"distill.{key}", f"{key} {block[key]} is outside [0, 1]: {meaning}", f"set distill.{key} "
                   "between 0 and 1")
           for key, meaning in (("beta", "it weighs the two KL terms of the generalised JSD (0: forward KL, 1: "
                                         "reverse KL)"), ("lmbda", "it is the share of on-policy micro-batches"))
           if block.get(key) is not None and not 0 <= block[key] <= 1]
    if goal == "distill" and block.get("lmbda") is not None:
        out.append(Problem("distill.lmbda", f"lmbda {block['lmbda']} with objective distill: TRL's "
                           "DistillationConfig has no lmbda, every completion is the student's own",
                           "drop distill.lmbda, or use objective gkd (lmbda chooses per micro-batch)"))
    if not out:
        out += _on_policy_problems(recipe, goal)
    return out + _teacher_problems(recipe) + _layout_problems(ds, recipe, goal)


def _on_policy_problems(recipe: dict, goal: str) -> list[Problem]:
    """seq_kd (the teacher generates the rows the student does not) where the teacher cannot generate; the
    precomputed teacher's refusal with any generated completion is config/distill_topk_rules.py's."""
    if not settings(recipe)["seq_kd"]:
        return []
    if goal == "distill":
        return [Problem("distill.seq_kd", "seq_kd true with objective distill: TRL's DistillationConfig has no seq_kd, "
                        "every completion is the student's own", "drop distill.seq_kd, or use objective gkd")]
    if teacher_mode(recipe) == "served":
        return [Problem("distill.seq_kd", "seq_kd true with teacher_mode served: the teacher would generate the "
                        "completions, and a served teacher only scores the tokens it is sent (prompt log-probs); "
                        "sampled on the server, a row would not draw from its own seeded stream, so a resume or "
                        "another world size would get other completions",
                        "use teacher_mode engine (or adapter under LoRA) for seq_kd, or set distill.seq_kd=false")]
    return []


def _teacher_problems(recipe: dict) -> list[Problem]:
    """The teacher mode against the run; the top-k modes' own rules are in config/distill_topk_rules.py."""
    block = recipe.get("distill", {})
    mode, teacher = block.get("teacher_mode", "auto"), block.get("teacher_model_name_or_path")
    out = topk_problems(recipe, teacher_mode(recipe), settings(recipe), on_policy(recipe))
    if mode == "adapter" and not lora_on(recipe):
        out.append(Problem("distill.teacher_mode", "teacher_mode adapter without LoRA: the teacher is the student's "
                           "base with the adapters switched off, and there are none",
                           "set adapter.type=lora, or teacher_mode engine"))
    elif mode == "adapter" and teacher is not None:
        out.append(Problem("distill.teacher_model_name_or_path", f"teacher_mode adapter with a teacher model "
                           f"({teacher}): the adapter mode's teacher is the student's own base",
                           "drop distill.teacher_model_name_or_path, or use teacher_mode engine"))
    return out


def _layout_problems(ds: dict, recipe: dict, goal: str) -> list[Problem]:
    """Layouts whose step does not see a completion's logits over the whole vocabulary in one forward."""
    why = {"parallel.pipeline": "a pipeline's loss runs on its last stage per micro-batch of rows, where the "
                                "teacher's distributions would have to meet the student's",
           "parallel.tensor": "the tensor-parallel head's logits are split by vocabulary; the divergence needs both "
                              "softmaxes over the whole vocabulary",
           "parallel.sequence": "each rank holds a slice of every sequence; the teacher would need the same slices"}
    return refused_layouts(ds, recipe, goal, why, tiled="the distillation loss is computed in token chunks of its "
                           "own (distill.loss_chunk_tokens)", loss_name="the distillation loss")
