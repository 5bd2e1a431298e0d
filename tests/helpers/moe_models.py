"""Tiny fp32 Mixture-of-Experts folders of every family the harness trains (harness/config/moe_families.py), made
from transformers' config classes with seeded random weights and the shipped tokenizer, and the one-process
reference they are compared with: the same model, the same global batch split in the ranks' micro-batches (the
balancing loss of each chunk, as each rank computes its own), torch AdamW and clip_grad_norm_."""

from __future__ import annotations

import torch

SEED = 1234
COMMON = dict(vocab_size=512, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, tie_word_embeddings=False, attention_dropout=0.0, rms_norm_eps=1e-5)


def configs() -> dict:
    """family -> its transformers config (4 routed experts, top 2, so EP 2 holds 2 per rank)."""
    from transformers import (DeepseekV3Config, GptOssConfig, MixtralConfig, OlmoeConfig, Qwen2MoeConfig,
                              Qwen3MoeConfig)

    return {
        "qwen3_moe": Qwen3MoeConfig(**COMMON, head_dim=8, intermediate_size=64, moe_intermediate_size=16,
                                    num_experts=4, num_experts_per_tok=2),
        "mixtral": MixtralConfig(**COMMON, head_dim=8, intermediate_size=16, num_local_experts=4,
                                 num_experts_per_tok=2),
        "qwen2_moe": Qwen2MoeConfig(**COMMON, intermediate_size=64, moe_intermediate_size=16,
                                    shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2),
        "olmoe": OlmoeConfig(**COMMON, intermediate_size=16, num_experts=4, num_experts_per_tok=2),
        "deepseek_v3": DeepseekV3Config(**{**COMMON, "num_key_value_heads": 4}, intermediate_size=64, moe_intermediate_size=16, n_routed_experts=4,
                                        n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
                                        first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,
                                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8),
        "gpt_oss": GptOssConfig(**COMMON, head_dim=8, intermediate_size=16, num_local_experts=4,
                                num_experts_per_tok=2, sliding_window=16),
    }


def folder(family: str, path, seed: int = SEED) -> str:
    """A safetensors folder of a tiny `family` model (fp32) with the shipped tokenizer."""
    from transformers import AutoModelForCausalLM

    from harness.model.hf import _shipped_eos_id, load_tokenizer

    config = configs()[family]
    config.bos_token_id = config.eos_token_id = _shipped_eos_id()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    load_tokenizer("tiny-llama").save_pretrained(path)
    return str(path)


def reference(model: str, batches, *, lr: float, betas, eps: float, weight_decay: float, clip: float,
              aux: bool, chunks: int, seed: int = SEED) -> list[dict]:
    """One process: per step {loss, lm_loss, aux_loss, grad_norm}; `batches` is a list of (ids, labels[, position_ids])
    global batches, each split into `chunks` equal micro-batches whose losses are averaged (DeepSpeed's rank mean)."""
    from harness.model.hf import build_model

    net = build_model(model, seed=seed).float().train()
    net.config.output_router_logits = aux
    coef = net.config.router_aux_loss_coef if aux else 0.0
    opt = torch.optim.AdamW(net.parameters(), lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
    out = []
    from harness.data.rows import model_inputs

    for batch in batches:  # (ids, labels[, position_ids]) as Rows.tensors() gives them
        parts = [net(**model_inputs(chunk), use_cache=False) for chunk in zip(*(t.chunk(chunks) for t in batch))]
        loss = torch.stack([p.loss for p in parts]).mean()
        aux_loss = torch.stack([p.aux_loss for p in parts]).mean().item() if aux else None
        opt.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(net.parameters(), clip).item()
        opt.step()
        out.append({"loss": loss.item(), "aux_loss": aux_loss,
                    "lm_loss": loss.item() - coef * aux_loss if aux else loss.item(), "grad_norm": norm})
    return out


def biased_folder(path, seed: int = SEED) -> str:
    """A Qwen3-MoE folder whose router sends token ids < 256 to experts {0, 1} and the others to {2, 3} in every
    layer: hidden dimension 0 of the embedding is +3 or -3 by that split, no attention output and no expert writes
    into dimension 0 (so the residual stream keeps it), and each router reads it with weights +20, +20, -20, -20."""
    from safetensors.torch import load_file, save_file

    folder(path=path, family="qwen3_moe", seed=seed)
    file = f"{path}/model.safetensors"
    state = load_file(file)
    state["model.embed_tokens.weight"][:, 0] = torch.where(torch.arange(512) < 256, 3.0, -3.0)
    assert sum(key.endswith("mlp.gate.weight") for key in state) == 2, sorted(state)
    for key, value in state.items():
        if key.endswith("self_attn.o_proj.weight"):
            value[0, :] = 0.0
        elif ".mlp.experts." in key and key.endswith("down_proj.weight"):  # saved one tensor per expert
            value[0, :] = 0.0
        elif key.endswith("mlp.gate.weight"):
            value[:, 0] = torch.tensor([20.0, 20.0, -20.0, -20.0])
    save_file(state, file, metadata={"format": "pt"})
    return str(path)


def disjoint_batches(steps: int, micro: int, seq_len: int, ranks: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Global batches whose first `micro` rows (rank 0's) hold token ids < 256 and the next `micro` (rank 1's)
    ids >= 256."""
    gen = torch.Generator().manual_seed(SEED)
    out = []
    for _ in range(steps):
        ids = torch.cat([torch.randint(256 * (r % 2), 256 * (r % 2) + 256, (micro, seq_len), generator=gen)
                         for r in range(ranks)])
        out.append((ids, ids.clone()))
    return out
