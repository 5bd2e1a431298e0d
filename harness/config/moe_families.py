"""The one table of MoE families the harness trains: per HF model_type, what ZeRO-3 must treat as one leaf, which
DeepSpeed AutoEP preset places its experts (None: AutoEP cannot), where the routed experts and the router live, and
whether the model has a load-balancing (aux) loss. Pure data plus look-ups: no torch. The planner (planner/moe/)
and the run (model/moe/, checkpoint/) both read it.

Read from transformers 5.24 (fused experts: one `*Experts` module with 3D gate_up_proj/down_proj per MoE block) and
DeepSpeed 0.19.8 (module_inject/auto_ep_presets/: mixtral, qwen3_moe (also Qwen2-MoE; OLMoE runs under it),
deepseek_v3; gpt-oss is not detected). DeepSpeed marks only the Mixtral, Qwen2-MoE and Qwen3-MoE sparse blocks as
ZeRO-3 leaves by default; the harness always passes this table's classes instead.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    name: str
    leaf_classes: tuple[str, ...]  # zero_optimization.leaf_module.classes (class names)
    autoep_preset: str | None  # expert_parallel.preset_model; None = AutoEP cannot place these experts
    experts: str  # attribute of the MoE block holding the fused routed experts
    router: str  # attribute of the MoE block holding the router (its forward returns logits, scores, indices)
    router_class: str  # the router module's class name (tokens per expert are counted on its output)
    experts_attr: str  # config attribute: number of routed experts
    top_k_attr: str
    expert_width_attr: str  # config attribute: the intermediate size of one routed expert's MLP
    aux_loss: bool  # HF adds router_aux_loss_coef x load-balancing loss when output_router_logits=True
    bias_balanced: bool = False  # routing bias buffer (e_score_correction_bias): aux-free balancing
    ep_router_logits: bool = True  # under AutoEP the router logits (so the aux loss) still reach the HF loss
    note: str = ""


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("mixtral", ("MixtralSparseMoeBlock",), "mixtral", "experts", "gate", "MixtralTopKRouter",
           "num_local_experts", "num_experts_per_tok", "intermediate_size", aux_loss=True),
    Family("qwen2_moe", ("Qwen2MoeSparseMoeBlock",), "qwen3_moe", "experts", "gate", "Qwen2MoeTopKRouter",
           "num_experts", "num_experts_per_tok", "moe_intermediate_size", aux_loss=True,
           note="shared expert with a sigmoid gate"),
    Family("qwen3_moe", ("Qwen3MoeSparseMoeBlock",), "qwen3_moe", "experts", "gate", "Qwen3MoeTopKRouter",
           "num_experts", "num_experts_per_tok", "moe_intermediate_size", aux_loss=True),
    Family("olmoe", ("OlmoeSparseMoeBlock",), "qwen3_moe", "experts", "gate", "OlmoeTopKRouter",
           "num_experts", "num_experts_per_tok", "intermediate_size", aux_loss=True, ep_router_logits=False,
           note="AutoEP's qwen3_moe router-logit adapter matches Qwen2/3-MoE classes only: no aux loss under EP"),
    Family("deepseek_v3", ("DeepseekV3MoE",), "deepseek_v3", "experts", "gate", "DeepseekV3TopkRouter",
           "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", aux_loss=False, bias_balanced=True,
           note="MLA attention, first_k_dense_replace dense layers, shared experts, sigmoid router with a bias"),
    Family("gpt_oss", ("GptOssMLP",), None, "experts", "router", "GptOssTopKRouter",
           "num_local_experts", "num_experts_per_tok", "intermediate_size", aux_loss=True,
           note="experts interleaved and transposed, with biases; no AutoEP preset detects them"),
)}


AUTOEP_FAMILIES = tuple(name for name, f in FAMILIES.items() if f.autoep_preset)  # model types AutoEP can place


def field(model_config, key: str, default=None):
    """A config value from a transformers config object or its dict (config.json, model_shapes presets)."""
    if isinstance(model_config, dict):
        return model_config.get(key, default)
    return getattr(model_config, key, default)


def family_of(model_config) -> Family | None:
    """The family of a transformers config or config dict (None: dense, or a MoE family the harness does not know)."""
    return FAMILIES.get(field(model_config, "model_type")) if model_config is not None else None


EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")  # config.json spellings vary:
# transformers 5.24 writes Qwen3-MoE's num_experts as num_local_experts (its attribute_map alias)


def num_experts(family: Family, model_config) -> int:
    for key in (family.experts_attr, *EXPERT_COUNT_KEYS):
        if field(model_config, key) is not None:
            return int(field(model_config, key))
    raise KeyError(f"{family.name} config names no expert count ({', '.join(EXPERT_COUNT_KEYS)})")


def aux_coef(model_config) -> float | None:
    """The model's own balancing-loss coefficient (config.router_aux_loss_coef), None where it has none."""
    value = field(model_config, "router_aux_loss_coef")
    return float(value) if value is not None else None


EAGER_ONLY = ("gpt_oss",)  # transformers 5.24: GptOssForCausalLM has no sdpa path (attention sinks)


def attn_implementation(model_config, default: str) -> str:
    """The attention kernel a family can build with: eager where transformers refuses sdpa, else `default`."""
    return "eager" if field(model_config, "model_type") in EAGER_ONLY else default


def leaf_module(family: Family) -> dict:
    """zero_optimization.leaf_module for a family: its MoE block, so ZeRO-3 gathers all experts at block entry."""
    return {"classes": list(family.leaf_classes)}


def known() -> str:
    return ", ".join(f"{f.name} ({f.autoep_preset or 'no AutoEP'})" for f in FAMILIES.values())
