"""Model shapes without weights: built-in presets and well-known models as HF config dicts.

One source of truth for "what shape is model X": the runner builds tiny presets from these dicts
(random weights), the planner counts parameters from them, the validator checks tp against heads.
Pure: no torch import here.
"""

from __future__ import annotations

import json
from pathlib import Path

from harness.errors import UsageError

TINY_VOCAB_SIZE = 512  # the built-in tokenizer's vocabulary (harness/assets/tokenizer.json)

# Tiny presets are trained for real by tests and the demo. tiny-llama has 4 heads and 2 kv heads
# so tensor parallel can split it 2 ways evenly.
_TINY_DECODER = {  # what the tiny decoder presets share: 2 layers of width 64, 4 heads over 2 kv heads
    "vocab_size": TINY_VOCAB_SIZE,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "attention_dropout": 0.0,
}
PRESETS: dict[str, dict] = {
    "tiny-llama": dict(_TINY_DECODER, model_type="llama", intermediate_size=176),
    "tiny-gpt2": {
        "model_type": "gpt2",
        "vocab_size": TINY_VOCAB_SIZE,
        "n_embd": 64,
        "n_layer": 2,
        "n_head": 4,
        "n_positions": 512,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
    },
    # Tiny MoE presets (recipes moe_zero3, moe_ep): 4 routed experts, top-2, so EP 2 holds 2 experts per rank.
    "tiny-qwen3-moe": dict(_TINY_DECODER, model_type="qwen3_moe", intermediate_size=176, moe_intermediate_size=64,
                           num_experts=4, num_experts_per_tok=2, head_dim=16),
    "tiny-mixtral": dict(_TINY_DECODER, model_type="mixtral", intermediate_size=64, num_local_experts=4,
                         num_experts_per_tok=2),
}

# Well-known models, shapes only (for planning and validation, never downloaded). Values are those of
# the models' published HF config.json files; keys are lower-case names.
_GPT2 = {"model_type": "gpt2", "vocab_size": 50257, "n_positions": 1024, "layer_norm_epsilon": 1e-5}
_LLAMA2 = {"model_type": "llama", "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
           "rope_theta": 10000.0, "tie_word_embeddings": False}
_LLAMA3 = {"model_type": "llama", "vocab_size": 128256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
           "rope_theta": 500000.0, "tie_word_embeddings": False}
_LLAMA31 = dict(_LLAMA3, max_position_embeddings=131072)
KNOWN: dict[str, dict] = {
    "gpt2": dict(_GPT2, n_embd=768, n_layer=12, n_head=12),
    "gpt2-medium": dict(_GPT2, n_embd=1024, n_layer=24, n_head=16),
    "gpt2-large": dict(_GPT2, n_embd=1280, n_layer=36, n_head=20),
    "gpt2-xl": dict(_GPT2, n_embd=1600, n_layer=48, n_head=25),
    "tinyllama-1.1b": dict(_LLAMA2, max_position_embeddings=2048, hidden_size=2048, intermediate_size=5632,
                           num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4),
    "llama-2-7b": dict(_LLAMA2, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=32),
    "llama-2-13b": dict(_LLAMA2, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                        num_attention_heads=40, num_key_value_heads=40),
    "llama-2-70b": dict(_LLAMA2, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8),
    "llama-3-8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8),
    "llama-3-70b": dict(_LLAMA3, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8),
    "llama-3.1-8b": dict(_LLAMA31, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8),
    "llama-3.1-70b": dict(_LLAMA31, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                          num_attention_heads=64, num_key_value_heads=8),
    "llama-3.1-405b": dict(_LLAMA31, hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                           num_attention_heads=128, num_key_value_heads=8),
    "llama-3.2-1b": dict(_LLAMA31, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True),
    "llama-3.2-3b": dict(_LLAMA31, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                         num_attention_heads=24, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "mistral-7b": {"model_type": "mistral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                   "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                   "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                   "sliding_window": 4096, "tie_word_embeddings": False},
    "qwen2.5-7b": {"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
                   "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                   "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                   "tie_word_embeddings": False},
    # Mixture of Experts (harness/planner/moe/counts.py counts total and active parameters)
    "mixtral-8x7b": {"model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                     "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                     "num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02,
                     "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
                     "tie_word_embeddings": False},
    "qwen3-30b-a3b": {"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
                      "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
                      "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
                      "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
                      "norm_topk_prob": True, "router_aux_loss_coef": 0.001, "max_position_embeddings": 40960,
                      "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False},
    "deepseek-v3": {"model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
                    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "first_k_dense_replace": 3,
                    "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 256,
                    "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
                    "routed_scaling_factor": 2.5, "norm_topk_prob": True, "q_lora_rank": 1536, "kv_lora_rank": 512,
                    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                    "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                    "tie_word_embeddings": False},
    "gpt-oss-120b": {"model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880,
                     "num_hidden_layers": 36, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
                     "num_local_experts": 128, "num_experts_per_tok": 4, "router_aux_loss_coef": 0.9,
                     "attention_bias": True, "sliding_window": 128,
                     "layer_types": ["sliding_attention", "full_attention"] * 18, "max_position_embeddings": 131072,
                     "rms_norm_eps": 1e-5, "rope_theta": 150000.0, "swiglu_limit": 7.0, "tie_word_embeddings": False},
    "olmoe-1b-7b": {"model_type": "olmoe", "vocab_size": 50304, "hidden_size": 2048, "intermediate_size": 1024,
                    "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 64,
                    "num_experts_per_tok": 8, "router_aux_loss_coef": 0.01, "max_position_embeddings": 4096,
                    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False},
}


# Model types whose decoder layers have llama's layout (q/k/v/o attention with GQA, gate/up/down MLP, RMSNorm,
# rotary positions): the planner counts their parameters in closed form (planner/params.py), tensor parallel splits
# them (model/parallel/tensor.py) and pipelines stage them as "llama" layers (model/parallel/pipeline.py).
LLAMA_LIKE = ("llama", "mistral", "qwen2")
# Model types the harness turns into pipeline stages, by layer family ("gpt2": learned positions).
PIPELINE_FAMILIES: dict[str, str] = {**dict.fromkeys(LLAMA_LIKE, "llama"), "gpt2": "gpt2"}


def is_preset(spec: str) -> bool:
    return spec in PRESETS


def load_model_config(spec: str) -> dict:
    """Return an HF config dict for a preset name, a known model name, a local dir or config.json.

    Hub ids are not resolved here (that needs network and transformers): callers that may go
    online use transformers.AutoConfig themselves.
    """
    if spec in PRESETS:
        return dict(PRESETS[spec])
    if spec.lower() in KNOWN:
        return dict(KNOWN[spec.lower()])
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            return with_text_fields(json.loads(path.read_text()))
        except json.JSONDecodeError as e:
            raise UsageError(f"{path}: not valid JSON ({e})") from None
    choices = ", ".join(sorted(PRESETS) + sorted(KNOWN))
    raise UsageError(
        f"unknown model {spec!r}: not a built-in preset or known shape, and no config.json at {spec}\n"
        f"    choose one of: {choices}, or pass a local model directory"
    )


def with_text_fields(cfg: dict) -> dict:
    """A vision-language config (text_config + vision_config: Qwen2-VL, LLaVA, ...) with its language model's
    fields (hidden_size, layers, vocab, positions) also at the top, where the shape, bucket and position rules read
    them; top-level keys win. Any other config unchanged."""
    text = cfg.get("text_config")
    if not (isinstance(text, dict) and cfg.get("vision_config")):
        return cfg
    return {**{k: v for k, v in text.items() if k != "model_type"}, **cfg}


def shape_summary(cfg: dict) -> dict:
    """Normalised shape fields across model families (llama-style and gpt2-style names)."""
    hidden = cfg.get("hidden_size", cfg.get("n_embd"))
    heads = cfg.get("num_attention_heads", cfg.get("n_head"))
    return {
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": cfg.get("num_key_value_heads", heads),
        "num_hidden_layers": cfg.get("num_hidden_layers", cfg.get("n_layer")),
        "intermediate_size": cfg.get("intermediate_size", cfg.get("n_inner") or (4 * hidden if hidden else None)),
        "vocab_size": cfg.get("vocab_size"),
        "model_type": cfg.get("model_type"),
        "vision": bool(cfg.get("vision_config")),  # a vision-language model (config/vision_rules.py)
    }


def tp_problems(shape: dict, tp: int, name: str = "") -> list[tuple[str, str]]:
    """(what, fix) for each reason a model (shape_summary) cannot be split over `tp` tensor-parallel ranks."""
    if tp <= 1:
        return []
    model = f"model {name} " if name else "the model "
    kind = shape.get("model_type")
    if kind is not None and kind not in LLAMA_LIKE:
        return [(f"{model}has model_type {kind!r}; tensor parallel splits {', '.join(LLAMA_LIKE)} decoder layers "
                 "only", "use parallel.tensor 1 (ZeRO data parallel, or a pipeline) for this model")]
    out = []
    for field in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        n = shape.get(field)
        if isinstance(n, int) and n % tp:
            out.append((f"{field} ({n}) of {model}must be divisible by the tensor degree ({tp}): "
                        f"{n} / {tp} = {n / tp:g} per rank", f"use a tensor degree that divides {n}"))
    return out


# Ulysses sequence parallelism (DeepSpeed's UlyssesSPAttentionHF) switches attention from sequence-split to
# head-split: each of the sp ranks takes heads / sp attention heads, and the kv heads are split over the sp ranks
# or replicated sp / kv times (ulysses_sp.py kv_replication_factor). The planner and the run's checks both ask here.
def ulysses_splits_heads(heads: int, sp: int) -> bool:
    return heads % sp == 0


def ulysses_splits_kv_heads(kv_heads: int, sp: int) -> bool:
    return kv_heads % sp == 0 or sp % kv_heads == 0
