"""The reference model (or a distillation run's teacher: the same machinery) as an engine: built by the policy's own path (harness/model/build.py) in the run's precision,
inference only, wrapped by deepspeed.initialize WITHOUT any optimizer block (trl#825: a reference engine built from
the policy's config inherits its optimizer); ZeRO-3-sharded like the policy where the policy is ZeRO-3. Used by the
engine mode for every step and by the precomputed mode for its one pass (train/reference.py), and by the teacher's
engine mode (train/teacher.py).
"""

from __future__ import annotations

import dataclasses

import torch

from harness.config.objectives import objective_of
from harness.config.recipes import deep_merge
from harness.train.objectives import label_logps


MODEL_KEYS = {"preference": "reference", "rl": "reference", "distill": "teacher_model_name_or_path"}  # block -> key


def reference_name(spec) -> str:
    """The extra model's folder or hub id: preference.reference (rl.reference for an RL run, distill.
    teacher_model_name_or_path for a distillation run's teacher), else the policy's starting weights."""
    block = objective_of(spec.recipe).block or "preference"
    return spec.recipe[block][MODEL_KEYS[block]] or spec.recipe["train"]["model"]


def _reference_spec(spec):
    """The policy's spec with the reference as its model, inference only: no LoRA, no recomputation."""
    recipe = deep_merge(spec.recipe, {"train": {"model": reference_name(spec)}, "activation_checkpointing": False,
                                      "adapter": {"type": "none", "load_in_4bit": False}})
    return dataclasses.replace(spec, recipe=recipe)


def engine_config(spec) -> dict:
    """The reference engine's DeepSpeed dict: batch, precision and ZeRO-3 parameter sharding of the policy's, and
    nothing that makes an optimizer (no optimizer, scheduler or offload_optimizer block)."""
    ds, zero = spec.ds_config, spec.ds_config.get("zero_optimization", {})
    out = {"train_micro_batch_size_per_gpu": ds["train_micro_batch_size_per_gpu"], "gradient_accumulation_steps": 1,
           "steps_per_print": ds.get("steps_per_print", 10**6), "wall_clock_breakdown": False}
    for key in ("bf16", "fp16"):
        if ds.get(key, {}).get("enabled"):
            out[key] = {"enabled": True}
    if zero.get("stage") == 3:
        keep = {k: v for k, v in zero.items() if k.startswith("stage3_") or k in ("stage", "offload_param")}
        # No prefetch in a forward-only engine: once DeepSpeed 0.19.8's trace is complete, each module's fetch
        # prefetches at least one parameter whatever the bucket (modules without parameters of their own fetch too),
        # so the prefetch runs ahead of the forward and about half the frozen model was gathered at once from the
        # second forward on (bench/growth.py: +1.0 x the teacher's bytes per rank, not 1 / ranks). Without it a
        # rank holds its partition and the module being run, as the planner prices it.
        keep["stage3_prefetch_bucket_size"] = 0
        out["zero_optimization"] = keep
    else:
        out["zero_optimization"] = {"stage": 0}
    return out


def build_engine(spec):
    """(frozen reference engine, build notes): built like the policy (harness/model/build.py), then wrapped by
    deepspeed.initialize with engine_config (ZeRO-3: partitioned at construction, as the policy)."""
    import deepspeed

    from harness.log import quiet_scheduler_construction
    from harness.model.build import build

    built = build(_reference_spec(spec))
    module = built.module.eval()
    for param in module.parameters():
        param.requires_grad_(False)
    with quiet_scheduler_construction():
        engine, *_ = deepspeed.initialize(model=module, config=engine_config(spec))
    return engine, built.info


@torch.no_grad()
def forward_logps(engine, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The [2B] summed label log-probs of a no_grad forward (float64)."""
    logits = engine(input_ids=input_ids.to(engine.device), use_cache=False).logits
    return label_logps(logits, labels)[0]
