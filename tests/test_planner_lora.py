"""The planner with LoRA: adapter counts equal what peft builds, frozen parameters cost their 16-bit copy only, DP
gradient traffic covers the adapters while ZeRO-3 still gathers everything, and `harness plan --lora-r`."""

from __future__ import annotations

import pytest

from harness.config.run_model import Zero
from harness.model_shapes import KNOWN
from harness.planner import comm, memory
from harness.planner.params import count_params, with_lora


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gpt2"])
def test_adapter_counts_equal_peft(preset):
    from harness.config.recipes import load_recipe
    from harness.model import adapters
    from harness.model.hf import build_model, load_model_config

    recipe = load_recipe("lora_zero2", [f"train.model={preset}"])[0]
    model = adapters.apply(build_model(preset, seed=0), recipe)
    trainable, frozen = adapters.counts(model)
    cfg = load_model_config(preset).to_dict()
    count = with_lora(count_params(cfg), cfg, recipe["adapter"]["r"], recipe["adapter"]["target_modules"])
    assert count.trainable_params(count.num_layers) == trainable
    assert count.total == trainable + frozen
    assert count.lora_largest_tensor == max(p.numel() for p in model.parameters() if p.requires_grad)


def test_frozen_params_cost_their_16bit_copy_only():
    total, trainable, shards = 1_000_000, 10_000, 4
    full = memory.model_state_bytes(memory.Holding(total), Zero(2), zero_shards=shards, precision="bf16",
                                    convention="seed")
    lora = memory.model_state_bytes(memory.Holding(total, trainable=trainable), Zero(2), zero_shards=shards,
                                    precision="bf16", convention="seed")
    assert lora["params"]["gpu"] == full["params"]["gpu"] == 2 * total
    assert lora["optimizer_moments"]["gpu"] == 8 * trainable // shards
    z3 = memory.model_state_bytes(memory.Holding(total, largest_layer=1000, trainable=trainable), Zero(3),
                                  zero_shards=shards, precision="bf16")
    assert z3["params"]["gpu"] == 2 * total // shards  # ZeRO-3 divides the frozen weights too
    assert z3["fp32_master"]["gpu"] == 4 * trainable // shards


def test_dp_traffic_covers_the_adapters_and_zero3_still_gathers_the_base():
    total, trainable = 1_000_000, 10_000
    z2 = comm.comm_bytes_per_step(total, stage=2, zero_shards=4, precision="bf16", trainable_params=trainable)
    assert z2 == {"all_reduce": 2 * trainable, "all_gather_into_tensor": 2 * trainable // 4}
    z3 = comm.comm_bytes_per_step(total, stage=3, zero_shards=4, precision="bf16", trainable_params=trainable)
    assert z3["reduce_scatter_tensor"] == 2 * trainable
    assert z3["all_gather_into_tensor"] == 2 * 2 * total // 4


def test_harness_plan_lora_r(capsys):
    from harness.cli import main

    assert main(["plan", "--model", "llama-3-8b", "--gpus", "8", "--gpu-mem", "80GB", "--lora-r", "16"]) == 0
    out = capsys.readouterr().out
    assert "LoRA r=16: 41,943,040 trainable" in out  # 32 layers x 16 x (4096+4096 + 2x(4096+1024) + ...)
    assert "recommended: ddp" in out  # frozen 16-bit weights + adapters fit one 80 GB GPU; full FT needs ZeRO
    cfg = dict(KNOWN["llama-3-8b"])
    assert count_params(cfg).total + 41_943_040 == with_lora(count_params(cfg), cfg, 16).total

