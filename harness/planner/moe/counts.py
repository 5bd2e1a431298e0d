"""Mixture-of-Experts parameter counts from an HF config dict: total and active, per family, without weights.

transformers 5.24 builds the routed experts of a sparse block as one fused `*Experts` module (gate_up_proj
[E, 2I, H] and down_proj [E, H, I]; gpt-oss adds a bias per expert), beside a router (`gate`, or gpt-oss's
`router` with a bias) and, in Qwen2-MoE and DeepSeek-V3, shared experts that every token goes through. Which
blocks are sparse: Qwen2/3-MoE layer i when i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0;
DeepSeek-V3 from layer first_k_dense_replace on; Mixtral, OLMoE, gpt-oss every layer. DeepSeek-V3 attention is
MLA (q_lora_rank, kv_lora_rank, qk_nope/qk_rope/v head dims).

Active parameters per token: everything but the routed experts, plus top_k of the E routed experts per sparse
block. Embedding and LM head are counted in both (Mixtral's 12.9B, Qwen3-30B-A3B's 3.35B and OLMoE's 1.3B
are published that way; gpt-oss's 5.1B and DeepSeek-V3's 37B leave the input embedding out: tests say so).
Buffers (DeepSeek-V3's e_score_correction_bias) are not parameters. Tests hold every family equal to what
transformers builds on the meta device.
"""

from __future__ import annotations

from harness.config.moe_families import EXPERT_COUNT_KEYS, FAMILIES

# the config classes' defaults, where a config.json may leave a key out
_DEFAULT_TOP_K = {"mixtral": 2, "qwen2_moe": 4, "qwen3_moe": 8, "olmoe": 8, "deepseek_v3": 8, "gpt_oss": 4}


def num_experts(cfg: dict) -> int:
    """Routed experts per sparse block. transformers 5.24 writes Qwen3-MoE's num_experts as num_local_experts in a
    saved config.json (its attribute_map), so every spelling is read."""
    family = FAMILIES.get(cfg.get("model_type"))
    for key in (family.experts_attr if family else None, *EXPERT_COUNT_KEYS):
        if cfg.get(key):
            return int(cfg[key])
    return 0


def is_moe(cfg: dict) -> bool:
    return cfg.get("model_type") in FAMILIES


def sparse_layers(cfg: dict) -> list[bool]:
    """For each decoder layer, whether its MLP is a sparse (routed) block, as transformers 5.24 decides."""
    kind, layers = cfg["model_type"], cfg["num_hidden_layers"]
    if kind in ("qwen2_moe", "qwen3_moe"):
        step, dense = cfg.get("decoder_sparse_step", 1) or 1, set(cfg.get("mlp_only_layers") or [])
        return [i not in dense and (i + 1) % step == 0 for i in range(layers)]
    if kind == "deepseek_v3":
        first = cfg.get("first_k_dense_replace", 3) or 0
        return [i >= first for i in range(layers)]
    return [True] * layers


def attention_tensors(cfg: dict) -> list[int]:
    """Numel of one decoder layer's attention tensors (projections, biases, q/k norms, gpt-oss's sinks)."""
    kind, h, heads = cfg["model_type"], cfg["hidden_size"], cfg["num_attention_heads"]
    if kind == "deepseek_v3":
        rope, nope = cfg.get("qk_rope_head_dim", 64), cfg.get("qk_nope_head_dim", 128)
        v, kv_rank, q_rank = cfg.get("v_head_dim", 128), cfg.get("kv_lora_rank", 512), cfg.get("q_lora_rank", 1536)
        bias = cfg.get("attention_bias", False)
        q_out = heads * (nope + rope)
        q = [h * q_out] if q_rank is None else [h * q_rank, q_rank, q_rank * q_out] + ([q_rank] if bias else [])
        kv = [h * (kv_rank + rope), kv_rank, kv_rank * heads * (nope + v)] + ([kv_rank + rope] if bias else [])
        return q + kv + [heads * v * h] + ([h] if bias else [])
    kv_heads = cfg.get("num_key_value_heads") or heads
    hd = cfg.get("head_dim") or h // heads
    out = [h * heads * hd, h * kv_heads * hd, h * kv_heads * hd, heads * hd * h]
    if kind == "qwen2_moe" and cfg.get("qkv_bias", True):
        out += [heads * hd, kv_heads * hd, kv_heads * hd]
    if cfg.get("attention_bias", kind == "gpt_oss"):
        out += [heads * hd, kv_heads * hd, kv_heads * hd, h]
    if kind == "qwen3_moe":
        out += [hd, hd]  # q_norm, k_norm over one head
    if kind == "olmoe":
        out += [heads * hd, kv_heads * hd]  # q_norm, k_norm over all heads
    if kind == "gpt_oss":
        out += [heads]  # attention sinks
    return out


def expert_tensors(cfg: dict, num_experts: int, inter: int) -> list[int]:
    """The fused routed experts of one sparse block: gate_up_proj, down_proj (gpt-oss: and their biases)."""
    h = cfg["hidden_size"]
    out = [num_experts * 2 * inter * h, num_experts * h * inter]
    return out + ([num_experts * 2 * inter, num_experts * h] if cfg["model_type"] == "gpt_oss" else [])


def moe_layout(cfg: dict) -> dict | None:
    """Per-family sizes in parameters: one routed expert, the router and shared experts of one sparse block,
    the dense MLP of a dense layer, attention and norms of any layer; None for a dense model."""
    if not is_moe(cfg):
        return None
    kind, h = cfg["model_type"], cfg["hidden_size"]
    experts, inter = num_experts(cfg), cfg[FAMILIES[kind].expert_width_attr]
    routed = expert_tensors(cfg, experts, inter)
    router = [experts * h] + ([experts] if kind == "gpt_oss" else [])
    shared: list[int] = []
    if kind == "qwen2_moe" and cfg.get("shared_expert_intermediate_size"):
        shared = [h * cfg["shared_expert_intermediate_size"]] * 3 + [h]  # + shared_expert_gate (H -> 1)
    if kind == "deepseek_v3" and cfg.get("n_shared_experts"):
        shared = [h * inter * cfg["n_shared_experts"]] * 3
    dense_inter = cfg.get("intermediate_size", inter)
    sparse = sparse_layers(cfg)
    tensors = {"attention": attention_tensors(cfg), "norms": [h, h], "routed": routed, "router": router,
               "shared": shared, "dense_mlp": [h * dense_inter] * 3}
    return {"num_experts": experts, "top_k": cfg.get("num_experts_per_tok") or _DEFAULT_TOP_K[kind],
            "expert": sum(routed) // experts, "router": sum(router), "shared": sum(shared),
            "attention": sum(tensors["attention"]), "norms": 2 * h, "tensors": tensors,
            "dense_mlp": 3 * h * dense_inter, "moe_layers": sum(sparse),
            "dense_layers": len(sparse) - sum(sparse), "sparse": sparse,
            "embedding": cfg["vocab_size"] * h, "tied": bool(cfg.get("tie_word_embeddings", False)), "final_norm": h}


def moe_totals(m: dict) -> dict:
    """Whole-model sums of a moe_layout: total and active parameters, routed expert parameters, one sparse
    block (router + routed + shared experts: what ZeRO-3 gathers at once with the block as a leaf module)."""
    block = m["router"] + m["num_experts"] * m["expert"] + m["shared"]
    common = m["attention"] + m["norms"]
    outer = m["embedding"] * (1 if m["tied"] else 2) + m["final_norm"]
    total = outer + m["moe_layers"] * (common + block) + m["dense_layers"] * (common + m["dense_mlp"])
    routed = m["moe_layers"] * m["num_experts"] * m["expert"]
    inactive = m["moe_layers"] * (m["num_experts"] - m["top_k"]) * m["expert"]
    return {"total": total, "active": total - inactive, "routed_experts": routed, "moe_block": block,
            "moe_layer": common + block, "dense_layer": common + m["dense_mlp"]}
