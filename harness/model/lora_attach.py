"""LoRA at each build site: one call once the model, stage or shard exists and before deepspeed.initialize.

peft's layers on an HF model or a pipeline stage (model/adapters.py), or the harness's own tensor-parallel LoRA on
split decoder layers (model/parallel/tensor_lora.py). Called by model/parallel/pipe_engine.py and train/job.py.
"""

from __future__ import annotations

from harness.config.adapter_rules import lora_on
from harness.model import adapters
from harness.model.parallel import tensor_lora


def attach(target, spec, *, hf_model, tp_group: tuple | None = None, layers=None) -> str | None:
    """The one call at each build site, once the model, stage or shard exists: LoRA per the recipe (nothing for
    adapter.type none). target: the HF model (peft layers), or with tp_group = (group, rank, size) the module
    whose split decoder `layers` (default: hf_model.model.layers) get the tensor-parallel LoRA; hf_model names
    them. Returns the counts as a line for the start-up lines (None without LoRA)."""
    recipe = spec.recipe
    if not lora_on(recipe):
        return None
    if tp_group is None:
        if recipe["adapter"]["load_in_4bit"]:
            from peft import prepare_model_for_kbit_training

            prepare_model_for_kbit_training(target, use_gradient_checkpointing=recipe["activation_checkpointing"],
                                            gradient_checkpointing_kwargs={"use_reentrant": False})
        adapters.apply(target, recipe, hf_model=hf_model)
    else:
        names = {id(m): n for n, m in hf_model.named_modules()}
        layers = list(hf_model.model.layers) if layers is None else layers
        tensor_lora.apply([(names[id(layer)], layer) for layer in layers], recipe, *tp_group)
        tensor_lora.freeze_all_but_adapters(target)
        if recipe["activation_checkpointing"] and hasattr(target, "enable_input_require_grads"):
            target.enable_input_require_grads()
    trainable, frozen = adapters.counts(target)
    return (f"lora r={recipe['adapter']['r']} alpha={recipe['adapter']['alpha']}: {trainable:,} trainable "
            f"/ {frozen:,} frozen parameters on this rank ({100 * trainable / max(1, trainable + frozen):.2f}%)")
