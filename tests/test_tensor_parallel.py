"""Tensor-parallel decoder layers (harness/model/parallel/tensor.py) against the unsplit layer, on 2 real gloo
processes (torch.multiprocessing; no DeepSpeed engine): output, input gradient and every weight gradient equal
the whole layer's, for a Llama layer (with q/k/v/o and MLP biases, so the row-parallel bias is covered) and a
Qwen2 layer (GQA 4 heads / 2 kv heads, q/k/v biases). The layer is built and split on its own, outside any
model, as a pipeline stage holds it; merge_tensor (export's) puts the split gradients and weights back together.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from harness.errors import UsageError
from harness.dist import free_port

SIZE, TOKENS, BATCH = 2, 7, 3
RTOL, ATOL = 1e-5, 1e-6
KINDS = ("llama", "qwen2")


def _config(kind: str):
    from transformers import LlamaConfig, Qwen2Config

    common = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                  num_hidden_layers=1, vocab_size=64, attention_dropout=0.0)
    config = (LlamaConfig(**common, attention_bias=True, mlp_bias=True) if kind == "llama"
              else Qwen2Config(**common, tie_word_embeddings=True))
    config._attn_implementation = "sdpa"
    return config


def _layer_and_inputs(kind: str):
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

    config = _config(kind)
    layer_cls, rope_cls = {"llama": (LlamaDecoderLayer, LlamaRotaryEmbedding),
                           "qwen2": (Qwen2DecoderLayer, Qwen2RotaryEmbedding)}[kind]
    torch.manual_seed(0)
    layer = layer_cls(config, layer_idx=0)
    with torch.no_grad():  # HF leaves biases at zero and norms at one: make every parameter count
        for p in layer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    x = torch.randn(BATCH, TOKENS, config.hidden_size)
    weight = torch.randn(BATCH, TOKENS, config.hidden_size)  # loss = sum(out * weight)
    rope = rope_cls(config)(x, torch.arange(TOKENS).unsqueeze(0))
    return config, layer, x, weight, rope


def _run(layer, x, weight, rope):
    x = x.clone().requires_grad_(True)
    out = layer(x, position_embeddings=rope)
    (out * weight).sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}


def _compare(kind: str, rank: int) -> dict | None:
    """Rank 0 gets the differences between the split and the whole layer (both ranks run both)."""
    from harness.model.parallel.tensor import merge_tensor, shard_decoder_layer

    config, layer, x, weight, rope = _layer_and_inputs(kind)
    full_state = {k: v.clone() for k, v in layer.state_dict().items()}
    out_full, gx_full, grads_full = _run(layer, x, weight, rope)
    layer.zero_grad()
    shard_decoder_layer(layer, config, dist.group.WORLD, rank, SIZE)
    split = sorted(n for n, p in layer.named_parameters() if getattr(p, "tensor_model_parallel", False))
    out, gx, grads = _run(layer, x, weight, rope)
    gathered_grads, gathered_states = [None] * SIZE, [None] * SIZE
    dist.all_gather_object(gathered_grads, grads)
    dist.all_gather_object(gathered_states, layer.state_dict())
    if rank:
        return None
    merged_grads, merged_state = ({key: merge_tensor(key, [sd[key] for sd in parts]) for key in parts[0]}
                                  for parts in (gathered_grads, gathered_states))
    return {"out": ((out - out_full).abs().max().item(), out_full.abs().max().item()),
            "x_grad": ((gx - gx_full).abs().max().item(), gx_full.abs().max().item()),
            "grads": {n: ((merged_grads[n] - g).abs().max().item(), g.abs().max().item(),
                          merged_grads[n].shape == g.shape) for n, g in grads_full.items()},
            "weights_equal": all(torch.equal(merged_state[k], v) for k, v in full_state.items()),
            "split": split}


def _worker(rank: int, port: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=SIZE)
    try:
        found = {kind: _compare(kind, rank) for kind in KINDS}
        if rank == 0:
            results.put(found)
    finally:
        dist.destroy_process_group()
    from harness.dist import exit_now

    exit_now(0)  # no interpreter finalization after gloo (it can abort a finished rank, see exit_now)


@pytest.fixture(scope="module")
def compared() -> dict:
    """One spawn of 2 processes (~each start imports torch + transformers) checks every architecture."""
    results = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_worker, args=(free_port(), results), nprocs=SIZE, join=True, start_method="spawn")
    return results.get()


@pytest.mark.parametrize("kind", KINDS)
def test_split_layer_matches_the_whole_layer(kind, compared):
    r = compared[kind]
    for what in ("out", "x_grad"):
        diff, scale = r[what]
        assert diff <= ATOL + RTOL * scale, (what, diff, scale)
    for name, (diff, scale, same_shape) in r["grads"].items():
        assert same_shape and diff <= ATOL + RTOL * scale, (name, diff, scale)
    assert r["weights_equal"], "merge_tensor gives back the whole layer's weights"
    expected = {f"self_attn.{n}_proj.{k}" for n in "qkv" for k in ("weight", "bias")}
    expected |= {"self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"}
    if kind == "llama":
        expected |= {"mlp.gate_proj.bias", "mlp.up_proj.bias"}  # row-parallel biases stay whole
    assert r["split"] == sorted(expected)


def test_unsupported_models_and_degrees_are_refused_with_the_arithmetic():
    from transformers import GPT2Config

    from harness.model.parallel.tensor import supported

    with pytest.raises(UsageError, match="model_type 'gpt2'.*llama, mistral, qwen2"):
        supported(GPT2Config(), 2)
    with pytest.raises(UsageError, match=r"num_key_value_heads \(2\).*tensor degree \(4\): 2 / 4 = 0.5 per rank"):
        supported(_config("qwen2"), 4)
    supported(_config("qwen2"), 2)
