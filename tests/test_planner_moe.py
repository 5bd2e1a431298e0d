"""The planner on Mixture-of-Experts models (issue #26): total and active parameters, memory with experts over the
expert-parallel ranks, ZeRO-3's gathered sparse block, the all-to-all per sparse block, step time on active
parameters, and the ranking of expert parallelism against ZeRO-3 with leaves. Pure arithmetic: no ranks here (the
live engine's bytes per rank: tests/test_moe_plan_bytes.py)."""

from __future__ import annotations

import json

import pytest
import transformers

from harness.config.run_model import Zero
from harness.errors import UsageError
from harness.model_shapes import KNOWN
from harness.planner import comm, hardware, layouts, moe, plan, search, steptime
from harness.planner.inputs import Cluster, Workload
from harness.planner.memory import Holding, harness_buckets, zero3_gathered_elems
from harness.planner.params import count_params, meta_count, model_shape

# A Qwen2-MoE small enough to count by hand: layers 0 and 1 sparse, layer 2 dense (mlp_only_layers), a shared
# expert with its gate, q/k/v biases, untied embeddings.
TINY_QWEN2_MOE = {"model_type": "qwen2_moe", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96,
                  "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4,
                  "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
                  "decoder_sparse_step": 1, "mlp_only_layers": [2], "tie_word_embeddings": False}
ATTENTION = 64 * 64 + 2 * (64 * 32) + 64 * 64 + (64 + 32 + 32)  # q, k, v, o + q/k/v biases = 12,416
EXPERT = 3 * 64 * 32  # gate, up, down of one routed expert = 6,144
SPARSE_LAYER = ATTENTION + 2 * 64 + 4 * EXPERT + 4 * 64 + (3 * 64 * 48 + 64)  # + router, shared expert + gate
DENSE_LAYER = ATTENTION + 2 * 64 + 3 * 64 * 96
TOTAL = 2 * SPARSE_LAYER + DENSE_LAYER + 2 * 512 * 64 + 64  # = 189,888
ACTIVE = TOTAL - 2 * (4 - 2) * EXPERT  # two sparse blocks, 2 of 4 routed experts idle per token = 165,312

_TINY = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2}
FAMILIES = {
    "mixtral": dict(_TINY, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": TINY_QWEN2_MOE,
    "qwen3_moe": dict(_TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16,
                      decoder_sparse_step=2),
    "olmoe": dict(_TINY, num_experts=4, num_experts_per_tok=2),
    "deepseek_v3": dict(_TINY, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_group=1, topk_group=1),
    "gpt_oss": dict(_TINY, num_local_experts=4, num_experts_per_tok=2, head_dim=16, intermediate_size=64),
}


def test_total_and_active_by_hand():
    count = count_params(TINY_QWEN2_MOE)
    assert (TOTAL, ACTIVE) == (189_888, 165_312)
    assert (count.total, count.active, count.num_experts, count.top_k, count.moe_layers) == (TOTAL, ACTIVE, 4, 2, 2)
    assert count.routed_experts == 2 * 4 * EXPERT
    assert count.moe_block == 4 * 64 + 4 * EXPERT + 3 * 64 * 48 + 64  # router + routed + shared: one leaf


def _active_on_meta(model, top_k: int, num_experts: int) -> int:
    """Active parameters from what transformers built: every parameter but (E - k) / E of each fused expert
    tensor (the *Experts modules' 3D weights and their biases)."""
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for m in model.modules() if type(m).__name__.endswith("Experts")
                 for p in m.parameters(recurse=False))
    return total - routed * (num_experts - top_k) // num_experts


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_counts_what_transformers_builds(family):
    import torch

    cfg = dict(FAMILIES[family], model_type=family)
    config = transformers.AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    count, exact = count_params(cfg), meta_count(cfg)
    assert count.total == exact.total and count.tensor_sizes == exact.tensor_sizes
    assert count.largest_layer == exact.largest_layer
    assert count.active == _active_on_meta(model, 2, 4)
    assert count.active < count.total


def test_a_saved_config_counts_the_same():
    """transformers 5.24 saves Qwen3-MoE's num_experts as num_local_experts (config.json of a folder)."""
    cfg = dict(FAMILIES["qwen3_moe"], model_type="qwen3_moe")
    saved = transformers.AutoConfig.for_model(**cfg).to_dict()
    assert "num_experts" not in saved or saved["num_experts"] is None
    assert count_params(saved).total == count_params(cfg).total and count_params(saved).num_experts == 4
    assert model_shape(saved).num_experts == 4


# name: published total, published active, the active figure's rounding unit, whether it counts the input embedding.
# Sources: the models' cards / papers. Mixtral 46.7B / 12.9B (Mistral AI); Qwen3-30B-A3B 30.5B / 3.3B (Qwen card;
# 3.35B to three figures); DeepSeek-V3 671B / 37B (2412.19437; MTP module excluded, as in HF); gpt-oss-120b
# 116.83B / 5.13B (OpenAI's model card, active without the embedding); OLMoE-1B-7B 6.9B / 1.3B (2409.02060).
PUBLISHED = {"mixtral-8x7b": (46.7e9, 12.9e9, 0.1e9, True), "qwen3-30b-a3b": (30.5e9, 3.35e9, 0.01e9, True),
             "deepseek-v3": (671e9, 37e9, 1e9, False), "gpt-oss-120b": (116.83e9, 5.13e9, 0.01e9, False),
             "olmoe-1b-7b": (6.9e9, 1.3e9, 0.1e9, True)}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_known_moe_shapes_have_their_published_counts(name):
    total, active, unit, with_embedding = PUBLISHED[name]
    count = count_params(KNOWN[name])
    assert abs(count.total / total - 1) <= 0.01, f"{name}: {count.total:,} vs {total:,.0f}"
    ours = count.active - (0 if with_embedding else count.embedding)
    assert abs(ours - active) <= unit / 2, f"{name}: active {ours:,} vs published {active:,.0f} (+-{unit / 2:,.0f})"


def test_memory_with_experts_over_the_expert_parallel_ranks_by_hand():
    """ZeRO-2, fp32, 4 ranks, ep 2: this rank holds its 2 of 4 experts per sparse block whole, the rest of the
    model whole (16-bit copies are not sharded in ZeRO-2); fp32 master and Adam moments of the non-expert
    parameters over 4 ranks, of its experts over the 2 ranks holding the same experts."""
    count = count_params(TINY_QWEN2_MOE)
    dense, experts = TOTAL - 2 * 4 * EXPERT, 2 * 4 * EXPERT // 2
    states = moe.model_state_bytes(count, Holding(count.total), Zero(2), ep=2, zero_shards=4, precision="fp32",
                                   phase="after_step")
    assert states["params"]["gpu"] == 4 * (dense + experts)
    assert states["fp32_master"]["gpu"] == 4 * (-(-dense // 4) + experts // 2)
    assert states["optimizer_moments"]["gpu"] == 8 * (-(-dense // 4) + experts // 2)
    assert states["grads"]["gpu"] == 0  # ZeRO-2 frees gradients after the step
    one = moe.model_state_bytes(count, Holding(count.total), Zero(2), ep=1, zero_shards=4, precision="fp32",
                                phase="after_step")
    assert one["params"]["gpu"] == 4 * TOTAL


def test_zero3_with_leaves_gathers_one_sparse_block_whole():
    cfg = KNOWN["qwen3-30b-a3b"]
    count, shape = count_params(cfg), model_shape(cfg)
    hw = layouts.hardware(8, 2, 80 * 10**9, None, None)
    work = Workload(**{"seq_len": 2048, "micro_batch": 1, "precision": "bf16", "activation_checkpointing": False,
            "grad_accum": 1})
    r = layouts.evaluate(layouts.Candidate("zero3", 3), count, shape, hw, work)
    b = harness_buckets(2048)
    persistent = count.persistent_numel(b.param_persistence_threshold)
    block = 128 * 2048 + 128 * 3 * 2048 * 768  # router + 128 experts
    assert count.moe_block == block > count.largest_layer
    assert r["memory"]["model_states"]["gathered_params"]["gpu"] == 2 * zero3_gathered_elems(
        count.total - persistent, block, b)
    assert r["label"] == "zero3 leaves" and r["moe"]["leaves"]


@pytest.mark.parametrize("name, gpus, passes", [("bench", 2, 1), ("qwen3-30b-a3b", 8, 2)])
def test_zero3_gathered_bytes_count_the_passes_the_calls_do(name, gpus, passes):
    """ZeRO-3 all-gathers parameters in forward only while they fit in stage3_max_live_parameters (1e9; measured on
    bench/moe.py's 7.4M Mixtral: the comms logger's all_gather_into_tensor bytes per step are one pass), in forward
    and backward above it: the bytes the step time is priced on and the call count follow the same rule."""
    cfg = BENCH_MIXTRAL if name == "bench" else KNOWN[name]
    count, shape = count_params(cfg), model_shape(cfg)
    hw = layouts.hardware(gpus, 1, 80 * 10**9, None, None)
    work = Workload(**{"seq_len": 128, "micro_batch": 4, "precision": "fp32", "activation_checkpointing": False,
            "grad_accum": 3, "global_batch": 12 * gpus})
    c = layouts.Candidate("zero3", 3)
    r = layouts.evaluate(c, count, shape, hw, work)
    b = harness_buckets(shape.hidden_size)
    gathered = count.total - count.persistent_numel(b.param_persistence_threshold)
    persistent = count.total - gathered
    row = next(x for x in r["comm"]["rows"] if x["collective"] == "all_gather_into_tensor")
    assert row["logged_bytes"] == 4 * (-(-gathered // gpus) * passes * 3 + -(-persistent // gpus))
    calls = steptime.dp_calls(c, count, count.num_layers, 3, b, b.param_persistence_threshold,
                              comm.zero3_gathers(r["params_per_rank"]))
    assert calls["all_gather_into_tensor"] == passes * 3 * sum(
        1 for n in steptime.rank_tensors(count, count.num_layers, 1) if n > b.param_persistence_threshold)


def test_all_to_all_bytes_per_step_by_hand():
    count = count_params(TINY_QWEN2_MOE)
    per_call = 8 * 2 * 2 * 64 * 4  # seq 8 x micro-batch 2 tokens x top 2 x hidden 64 x fp32
    got = moe.all_to_all_bytes(count, 64, ep=2, seq_len=8, micro_batch=2, micro_batches=3, precision="fp32",
                               activation_checkpointing=False)
    assert got == per_call * 4 * 2 * 3  # dispatch + combine, forward + backward; 2 sparse blocks; 3 micro-batches
    recomputed = moe.all_to_all_bytes(count, 64, ep=2, seq_len=8, micro_batch=2, micro_batches=3,
                                      precision="fp32", activation_checkpointing=True)
    assert recomputed == per_call * 6 * 2 * 3
    shape = model_shape(TINY_QWEN2_MOE)
    hw = layouts.hardware(2, 1, 80 * 10**9, None, None)
    work = Workload(**{"seq_len": 8, "micro_batch": 2, "precision": "fp32", "activation_checkpointing": False,
            "grad_accum": 3})
    rows = layouts.evaluate(layouts.Candidate("zero2", 2, ep=2), count, shape, hw, work)["comm"]["rows"]
    a2a = next(r for r in rows if r["collective"] == "all_to_all_single")
    assert (a2a["group"], a2a["group_size"], a2a["logged_bytes"], a2a["wire_bytes"]) == ("ep", 2, got, got // 2)


def test_step_time_counts_active_flops_and_the_imbalance():
    cfg = KNOWN["qwen3-30b-a3b"]
    count, shape = count_params(cfg), model_shape(cfg)
    seq, tokens = 2048, 16 * 2048
    attention = 4 * seq * 32 * 128  # per token per block: QK^T and AV
    head = 2 * 2048 * 151936
    blocks = 2 * (count.active - 2 * 151936 * 2048 - 2048) + 48 * attention
    assert steptime.model_flops_per_step(count, shape, seq, tokens) == pytest.approx(3 * tokens * (blocks + head))
    hw = layouts.hardware(8, 2, 80 * 10**9, None, None)
    profile = hardware.load("h100-80gb-sxm")
    c = layouts.Candidate("zero1", 1, ep=8)
    times = {}
    for imbalance in (1.0, 1.5):
        work = Workload(**{"seq_len": seq, "micro_batch": 1, "precision": "bf16", "activation_checkpointing": False,
                "grad_accum": 1, "global_batch": 16, "expert_imbalance": imbalance})
        times[imbalance] = search.timed(c, count, shape, hw, work, profile, "m")["time"]["breakdown"]
    assert times[1.0]["expert_imbalance_s"] == 0 and times[1.0]["all_to_all_s"] > 0
    assert times[1.5]["all_to_all_s"] == pytest.approx(1.5 * times[1.0]["all_to_all_s"])
    routed = 3 * seq * 2 * 8 * count.routed_experts / 128 / hardware.achieved_flops(profile, "bf16")
    assert times[1.5]["expert_imbalance_s"] == pytest.approx(0.5 * routed)
    with pytest.raises(ValueError, match="expert_imbalance"):
        plan(cfg, Cluster(gpus_per_node=8, gpu_mem_bytes=80 * 10**9), Workload(expert_imbalance=0.5))


def _run(argv, capsys):
    import argparse

    from harness.commands import plan as plan_cmd

    parser = argparse.ArgumentParser()
    plan_cmd.add_arguments(parser)
    code = plan_cmd.run(parser.parse_args(argv))
    return code, capsys.readouterr().out


def test_plan_qwen3_30b_a3b_on_two_nodes_ranks_expert_parallel_above_zero3_leaves(capsys):
    argv = ["--model", "qwen3-30b-a3b", "--gpus", "8", "--nodes", "2", "--gpu-mem", "80GB"]
    code, text = _run(argv, capsys)
    assert code == 0
    assert "30.53 B total, 3.35 B active per token" in text
    code, out = _run(argv + ["--json"], capsys)
    result = json.loads(out)
    assert result["model"]["params"]["total"] == 30_532_122_624
    assert result["model"]["params"]["active"] == 3_353_032_704
    labels = [r["label"] for r in result["ranked"]]
    best_ep = min(i for i, label in enumerate(labels) if " ep" in label)
    assert best_ep < labels.index("zero3 leaves")
    assert result["recommended"]["overrides"]["parallel.expert"] > 1
    assert "--set parallel.expert=" in result["recommended"]["launch"]


def test_expert_parallel_refusals_name_the_reason(capsys):
    base = ["--gpus", "8", "--gpu-mem", "80GB", "--zero", "1"]
    with pytest.raises(UsageError, match=r"128 experts do not split over ep 3: 128 / 3"):
        _run(["--model", "qwen3-30b-a3b", "--ep", "3"] + base, capsys)
    with pytest.raises(UsageError, match="llama has no routed experts"):
        _run(["--model", "llama-2-7b", "--ep", "2"] + base, capsys)
    with pytest.raises(UsageError, match="AutoEP cannot place the experts of gpt_oss"):
        _run(["--model", "gpt-oss-120b", "--ep", "2"] + base, capsys)
    with pytest.raises(UsageError, match="ZeRO-1 or 2 without tp"):
        _run(["--model", "qwen3-30b-a3b", "--ep", "2", "--gpus", "8", "--gpu-mem", "80GB", "--zero", "3"], capsys)
    count = count_params(KNOWN["gpt-oss-120b"])
    assert not any(c.ep > 1 for c in layouts.candidates(8, 8, count.num_layers, 0))
    shape = model_shape(KNOWN["gpt-oss-120b"])
    assert "AutoEP" in layouts.not_applicable(layouts.Candidate("zero1", 1, ep=2), shape)


# Qwen3.6-35B-A3B (transformers 5.24's Qwen3_5MoeTextConfig defaults) cut to 20 layers, as a qwen2_moe the planner
# sizes: 256 routed experts of width 512, top 8, one shared expert of 512, vocab 248,320, 16 query / 2 KV heads of
# 256. Its Gated DeltaNet layers (3 of 4) become softmax attention (the planner has no linear attention): ~13M
# fewer parameters per layer, 1.5 % of the total.
QWEN36_CUT = {"model_type": "qwen2_moe", "vocab_size": 248320, "hidden_size": 2048, "intermediate_size": 5632,
              "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "num_hidden_layers": 20,
              "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "num_experts": 256,
              "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [], "qkv_bias": False,
              "tie_word_embeddings": False}


BENCH_MIXTRAL = {"model_type": "mixtral", "vocab_size": 512, "hidden_size": 256, "intermediate_size": 256,
                 "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 8,
                 "num_experts_per_tok": 2, "tie_word_embeddings": False}  # bench/moe.py's model


def predict_8064() -> dict:
    count, shape = count_params(QWEN36_CUT), model_shape(QWEN36_CUT)
    hw = layouts.hardware(8, 2, 80 * 10**9, None, None)
    work = Workload(**{"seq_len": 1024, "micro_batch": 1, "grad_accum": 4, "precision": "bf16",
            "activation_checkpointing": False, "global_batch": 64})  # micro 1 x 16 GPUs x 4 = 64 (the PR's text)
    return {name: search.timed(c, count, shape, hw, work, hardware.load("h100-80gb-sxm"), "m")
            for name, c in (("zero3", layouts.Candidate("zero3", 3)), ("ep", layouts.Candidate("zero1", 1, ep=8)))}


def test_deepspeed_8064_two_rows():
    """deepspeedai/DeepSpeed#8064 (tohtana, 2026-07-08): 2 x 8 H100, Qwen3.6-35B-A3B cut to 20 layers, seq 1K,
    global batch 64, micro-batch 1 (so 4 micro-steps). Measured: ZeRO-3 with leaves 1,746 tokens/s/GPU (52.2 GiB
    peak), ZeRO-1 with EP 8 3,588 (31.1 GiB). Predicted on the h100-80gb-sxm profile (QWEN36_CUT): ZeRO-3 with leaves
    ~404 tokens/s/GPU (24 GiB), EP 8 ~8,430 (31.4 GiB). What holds: EP ranks first; EP's peak memory within 15 %.
    What does not, and why (not fitted away):
    - EP is predicted 2.3x too fast. Its exposed traffic is small (the all-to-all stays in the node); the gap is
      compute the model does not see: ~285 ms measured per micro-step of 1,024 tokens against ~24 ms of GEMMs at
      0.45 of peak. Not in the model: the Gated DeltaNet layers (HF's torch fallback without flash-linear-attention
      is a Python loop over chunks), AutoEP's routing, permutations and the host sync for its split sizes each
      layer. Not separable from these two published rows: treat EP speed as an upper bound.
    - ZeRO-3 with leaves is predicted 4.3x too slow: per step it all-gathers the 17.6B parameters twice per
      micro-step and reduce-scatters their gradients each micro-step (~400 GB per rank), which at the profile's
      45 GB/s per GPU across nodes is ~9 s, while the run took 2.35 s: its collectives across the two nodes moved
      at >= 3.7x one NIC's rate (>= 2.5x had it kept the parameters for backward: ~260 GB), as NCCL's rings, one
      per NIC, would, sharing the node's eight NICs. The Megatron rows of
      test_published_runs.py (A1: data parallel over 4 nodes) fall outside +-15 % with that aggregate bandwidth, so
      the profile keeps the per-GPU figure: treat ZeRO-3-across-nodes speed as a lower bound."""
    got = predict_8064()
    ep, z3 = got["ep"], got["zero3"]
    assert ep["time"]["tokens_per_s_per_gpu"] > z3["time"]["tokens_per_s_per_gpu"]
    assert abs(ep["memory"]["gpu_bytes"] / 2**30 / 31.1 - 1) <= 0.15, ep["memory"]["gpu_bytes"] / 2**30
    assert ep["time"]["tokens_per_s_per_gpu"] >= 3588  # an upper bound (docstring)
    assert z3["time"]["tokens_per_s_per_gpu"] <= 1746  # a lower bound (docstring)
    print(f"#8064 predicted tokens/s/GPU: ZeRO-3 leaves {z3['time']['tokens_per_s_per_gpu']:.0f} (measured 1,746), "
          f"EP 8 {ep['time']['tokens_per_s_per_gpu']:.0f} (measured 3,588); peak GiB: ZeRO-3 leaves "
          f"{z3['memory']['gpu_bytes'] / 2**30:.1f} (52.2), EP 8 {ep['memory']['gpu_bytes'] / 2**30:.1f} (31.1)")
