"""A tiny Qwen3-MoE folder (fp32, 4 routed experts, top-2) from transformers' config class, for the MoE
checkpoint, export and LoRA tests. Fused experts: mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I]."""

from __future__ import annotations

from pathlib import Path

import torch

SEED = 1234


def qwen3_moe_folder(path: Path, seed: int = SEED) -> str:
    from safetensors.torch import save_file
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from harness.model.hf import _shipped_eos_id, load_tokenizer

    eos = _shipped_eos_id()
    config = Qwen3MoeConfig(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, norm_topk_prob=True,
                            max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=eos,
                            eos_token_id=eos, attention_dropout=0.0, output_router_logits=False)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config)
    # the fused layout (the model's own state dict), which the harness's loader reads by name; save_pretrained
    # would write per-expert hub keys (experts.N.gate_proj.weight), fused again by transformers at load
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path / "model.safetensors",
              metadata={"format": "pt"})
    config.save_pretrained(path)
    load_tokenizer("tiny-llama").save_pretrained(path)
    return str(path)
