"""Every default and constant the planner and the run share, defined once.

DeepSpeed's defaults are read from harness/schemas/ds_config.schema.json (which records DeepSpeed 0.19.8's
pydantic defaults, tests/test_ds_schema.py holds them to DeepSpeed), the recipes' from recipe.schema.json, so a
value lives in its schema and nowhere else. The rest are the harness's own rules, each with why.
Pure: no torch (a precision names its torch dtype by name; torch.<name> is the caller's).
"""

from __future__ import annotations

from harness.config.schema import DS_SCHEMA, RECIPE_SCHEMA, subschema


def ds_default(dotted: str):
    """DeepSpeed's default for a key of its config, e.g. "zero_optimization.reduce_bucket_size"."""
    return subschema(DS_SCHEMA, dotted)["default"]


def recipe_default(dotted: str):
    """The recipes' default for a key, e.g. "train.tile_tokens"."""
    return subschema(RECIPE_SCHEMA, dotted)["default"]


# --- DeepSpeed's ZeRO defaults, in elements (what a DeepSpeed dict that omits the key gets) ---
REDUCE_BUCKET_ELEMS = ds_default("zero_optimization.reduce_bucket_size")
PREFETCH_BUCKET_ELEMS = ds_default("zero_optimization.stage3_prefetch_bucket_size")
PARAM_PERSISTENCE_THRESHOLD = ds_default("zero_optimization.stage3_param_persistence_threshold")
SUB_GROUP_ELEMS = ds_default("zero_optimization.sub_group_size")
STAGE3_MAX_LIVE_PARAMETERS = ds_default("zero_optimization.stage3_max_live_parameters")  # recipes keep it
MAX_REUSE_DISTANCE_ELEMS = ds_default("zero_optimization.stage3_max_reuse_distance")
OPTIMIZER_SWAP_BUFFER_COUNT = ds_default("zero_optimization.offload_optimizer.buffer_count")
PARAM_SWAP_BUFFER_COUNT = ds_default("zero_optimization.offload_param.buffer_count")
PARAM_SWAP_BUFFER_ELEMS = ds_default("zero_optimization.offload_param.buffer_size")
# Not a config key: deepspeed/runtime/engine.py MEMORY_OPT_ALLREDUCE_SIZE, the bucket ZeRO-0 all-reduces
# gradients in (allreduce_gradients -> buffered_allreduce_fallback).
ZERO0_ALLREDUCE_BUCKET_ELEMS = 500_000_000

# --- The recipes' defaults the planner assumes where a run does not say ---
ALLGATHER_BUCKET_ELEMS = recipe_default("zero.allgather_bucket_size")  # ZeRO-1/2 parameter all-gather bucket
TILE_TOKENS = recipe_default("train.tile_tokens")  # tokens per tile of the tiled MLP and the tiled loss

# --- The harness's ZeRO buckets, sized from the model like the HF integration's "auto" (transformers
# integrations/deepspeed.py): a small model does not carry a 1 GB ZeRO-3 bucket (DeepSpeed issues #3734, #6936).
# zero_optimization key -> (elements from hidden_size, the formula in words)
MODEL_SIZED_BUCKETS = {
    "reduce_bucket_size": (lambda h: h * h, "hidden_size^2"),
    "stage3_prefetch_bucket_size": (lambda h: int(0.9 * h * h), "0.9 x hidden_size^2"),
    "stage3_param_persistence_threshold": (lambda h: 10 * h, "10 x hidden_size"),
}


def model_sized_buckets(hidden_size: int) -> dict[str, int]:
    """{zero_optimization key: elements} of the model-sized buckets for a model of this width."""
    return {key: formula(hidden_size) for key, (formula, _) in MODEL_SIZED_BUCKETS.items()}


PATH_PREFIXES = (".", "/", "~")  # a model or data spec starting so is a path, never a hub id

# --- Training precisions: bytes per element, and the torch dtype (by name) a precision computes in ---
PRECISION_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
PRECISION_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}

# --- Preference objectives (train.objective dpo / ipo / simpo / orpo): the metrics a train record carries, as TRL
# logs them (rewards = beta x log-ratio per side, margin, accuracy with a strict >, the summed log-probs) ---
PREFERENCE_METRICS = ("rewards_chosen", "rewards_rejected", "rewards_margin", "rewards_accuracy", "logps_chosen",
                      "logps_rejected")
REFERENCE_FREE = ("simpo", "orpo", "reward")  # objectives with no reference model
