"""The recipe's adapter block: --set adapter.type=lora on any recipe, LoRA+ per-group learning rates that DeepSpeed
accepts, and the combinations refused before launch with the reason (pure: no ranks)."""

from __future__ import annotations

import pytest

from harness.commands.common import context
from harness.config.recipes import load_recipe, recipe_names
from harness.config.validate import check_recipe
from harness.errors import ConfigError


EXPERTS = 'adapter.target_parameters=["mlp.experts.gate_up_proj","mlp.experts.down_proj"]'  # LoRA on fused experts


def checked(name: str, overrides: list[str], world: int = 8) -> dict:
    recipe, source = load_recipe(name, overrides)
    return check_recipe(recipe, context(recipe, world), source).ds_config


@pytest.mark.parametrize("name", [n for n in recipe_names() if n != "zero3_nvme"])
def test_lora_on_any_recipe(name):
    recipe, _ = load_recipe(name, ["adapter.type=lora"])
    assert recipe["adapter"]["type"] == "lora" and recipe["adapter"]["r"] == 8
    assert "q_proj" in recipe["adapter"]["target_modules"] and "c_attn" in recipe["adapter"]["target_modules"]
    checked(name, ["adapter.type=lora"])


def test_lora_plus_gives_deepspeed_one_max_lr_per_group():
    from helpers.deepspeed_verdict import deepspeed_accepts

    ds = checked("lora_zero2", ["adapter.lr_B_ratio=16", "optimizer.lr=0.0002"])
    assert ds["scheduler"]["params"]["warmup_max_lr"] == [0.0002, 0.0002 * 16]
    deepspeed_accepts(ds)


@pytest.mark.parametrize("recipe, overrides, path, words", [
    ("tp", ["adapter.use_dora=true"], "adapter.use_dora", "DoRA with tensor parallel"),
    ("3d", ["adapter.modules_to_save=[\"lm_head\"]"], "adapter.modules_to_save", "not implemented"),
    ("pipeline", ["adapter.use_dora=true"], "adapter.use_dora", "DoRA with a pipeline"),
    ("tp", ["adapter.dropout=0.1"], "adapter.dropout", "its own mask"),
    ("tp", ["adapter.target_modules=[\"lm_head\"]"], "adapter.target_modules", "split projections"),
    ("pipeline", ["adapter.load_in_4bit=true"], "adapter.load_in_4bit", "4-bit (QLoRA) base with a pipeline"),
    ("lora_zero3", ["adapter.load_in_4bit=true", "precision=fp32"], "adapter.load_in_4bit", "bf16 or fp16"),
    ("lora_zero2", [EXPERTS, "adapter.dropout=0.05"], "adapter.dropout", "cannot apply dropout"),
    ("lora_zero3", [EXPERTS, "adapter.use_dora=true"], "adapter.use_dora", "no DoRA"),
    ("pipeline", [EXPERTS], "adapter.target_parameters", "with a pipeline"),
    ("lora_zero2", [EXPERTS, "parallel.expert=2", "train.model=tiny-qwen3-moe"], "adapter.target_parameters",
     "AutoEP replaces"),
])
def test_combinations_that_cannot_run_are_refused_with_the_reason(recipe, overrides, path, words):
    with pytest.raises(ConfigError) as err:
        checked(recipe, ["adapter.type=lora", *overrides])
    text = str(err.value)
    assert path in text and words in text and "fix:" in text, text


def test_adapter_settings_without_lora_change_nothing():
    assert checked("tp", ["adapter.use_dora=true"]) == checked("tp", [])


def test_qlora_on_a_cpu_machine_is_a_clear_error_before_launch():
    import torch

    from harness.train.checks import qlora_problems

    recipe, _ = load_recipe("lora_zero3", ["adapter.load_in_4bit=true"])
    problems = qlora_problems(recipe)
    assert problems and all(p.path == "adapter.load_in_4bit" for p in problems)
    if not torch.cuda.is_available():
        assert "needs bitsandbytes on a CUDA GPU" in problems[0].message and "load_in_4bit=false" in problems[0].fix
    assert any("nothing to quantize" in p.message for p in problems)  # tiny-llama is a preset
