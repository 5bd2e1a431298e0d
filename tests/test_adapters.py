"""train/adapters.py against peft itself (one process, no ranks)."""

from __future__ import annotations


def test_adapter_file_keys_are_peft_own():
    """adapter_model.safetensors keys equal get_peft_model_state_dict's, DoRA magnitudes and modules_to_save too."""
    from peft import get_peft_model, get_peft_model_state_dict

    from harness.config.recipes import load_recipe
    from harness.model import adapters
    from harness.model.hf import build_model

    recipe = load_recipe("lora_zero2", ['adapter.modules_to_save=["lm_head"]', "adapter.use_dora=true"])[0]
    ours = adapters.apply(build_model("tiny-llama", seed=0), recipe)
    mine = {adapters.peft_key(n) for n, p in ours.named_parameters() if p.requires_grad}
    reference = get_peft_model(build_model("tiny-llama", seed=0), adapters.lora_config(recipe["adapter"], "llama"))
    assert mine == set(get_peft_model_state_dict(reference))
