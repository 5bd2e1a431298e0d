"""Tiny dense model folders written with save_pretrained (seeded random weights, the shipped tokenizer),
for tests that train or load a model from a local folder."""

from __future__ import annotations

import torch


def qwen2_folder(path, seed: int = 1234) -> str:
    """A tiny Qwen2 (GQA, q/k/v biases, tied embeddings) with seeded random weights and the shipped tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from harness.model.hf import _shipped_eos_id, load_tokenizer

    eos = _shipped_eos_id()
    config = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=eos, eos_token_id=eos, attention_dropout=0.0)
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).save_pretrained(path)
    load_tokenizer("tiny-llama").save_pretrained(path)
    return str(path)


def llama_folder(path, seed: int = 1234, layers: int = 2) -> str:
    """A tiny Llama (GQA, untied head) with seeded random weights and the shipped tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from harness.model.hf import _shipped_eos_id, load_tokenizer

    eos = _shipped_eos_id()
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, bos_token_id=eos, eos_token_id=eos, attention_dropout=0.0)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(path)
    load_tokenizer("tiny-llama").save_pretrained(path)
    return str(path)


def perturbed_folder(source, path, scale: float = 0.05, seed: int = 99) -> str:
    """A copy of a model folder with every weight moved by seeded noise (a reference that differs from the policy)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source, torch_dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * scale)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(source).save_pretrained(path)
    return str(path)
