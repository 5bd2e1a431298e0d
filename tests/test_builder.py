"""Recipe -> DeepSpeed dict: every shipped recipe builds, its ds_configs/ file is exactly the builder's output,
and the resolved config is accepted by the schema and by DeepSpeed's own DeepSpeedConfig (offline, world 1)."""
import json
from pathlib import Path

import pytest

from harness.config import builder
from harness.commands.common import context
from harness.config.recipes import complete, load_recipe, recipe_names
from harness.config.schema import DS_SCHEMA, validate
from harness.config.validate import check_recipe, strip_annotations
from helpers.deepspeed_verdict import deepspeed_accepts

REPO = Path(__file__).resolve().parents[1]
# World sizes each recipe is valid for (3d = pipeline 2 x tensor 2 needs a multiple of 4).
WORLDS = {name: (4, 8) if name == "3d" else (2, 8) for name in recipe_names()}
CASES = [(name, world) for name in sorted(WORLDS) for world in WORLDS[name]]


def resolved(name: str, world: int, overrides=()) -> dict:
    recipe, source = load_recipe(name, overrides)
    return strip_annotations(check_recipe(recipe, context(recipe, world), source).ds_config)


def test_eighteen_recipes_ship():
    assert len(recipe_names()) == 18  # twelve dense + long_context, moe_zero3, moe_ep, zero2_muon, zero2_bf16_states,
    # zero2_bf16_sr


@pytest.mark.parametrize("name", recipe_names())
def test_recipe_builds_and_matches_its_generated_file(name):
    recipe, _ = load_recipe(name)
    built = builder.build(recipe)
    assert built["$schema"] == builder.SCHEMA_REF
    assert (REPO / "ds_configs" / f"{name}.json").read_text() == json.dumps(built, indent=2) + "\n"
    assert validate(built, DS_SCHEMA) == [], "the world-independent file must pass the schema as written"


@pytest.mark.parametrize("name,world", CASES)
def test_resolved_config_passes_schema_and_deepspeed(name, world):
    cfg = resolved(name, world)
    assert '"auto"' not in json.dumps(cfg)
    assert validate(cfg, DS_SCHEMA) == []
    ds = deepspeed_accepts(cfg)
    assert ds.train_micro_batch_size_per_gpu == cfg["train_micro_batch_size_per_gpu"]
    assert ds.gradient_accumulation_steps == cfg["gradient_accumulation_steps"]
    assert ds.zero_optimization_stage == cfg["zero_optimization"]["stage"]
    assert ds.bfloat16_config.enabled is True and ds.float16_config.enabled is False


@pytest.mark.parametrize("name,world", [("ddp", 2), ("zero3_offload", 8)])
@pytest.mark.parametrize("precision", ["fp16", "fp32"])
def test_other_precisions_pass_deepspeed(name, world, precision):
    cfg = resolved(name, world, [f"precision={precision}"])
    assert validate(cfg, DS_SCHEMA) == []
    ds = deepspeed_accepts(cfg)
    assert (ds.float16_config.enabled, ds.bfloat16_config.enabled) == (precision == "fp16", False)
    if precision == "fp16":
        assert ds.float16_config.initial_scale_power == builder.FP16_DEFAULTS["initial_scale_power"]


def test_zero2_offload_is_the_seed_config():
    recipe, _ = load_recipe("zero2_offload")
    ds = builder.build(recipe)
    zero = ds["zero_optimization"]
    assert zero["stage"] == 2
    assert zero["offload_optimizer"]["device"] == "cpu"
    assert zero["contiguous_gradients"] is True and zero["overlap_comm"] is True
    assert ds["gradient_accumulation_steps"] == 4
    assert ds["train_batch_size"] == 256
    assert ds["train_micro_batch_size_per_gpu"] == "auto"  # 256 / (4 x world), filled at launch
    assert resolved("zero2_offload", 8)["train_micro_batch_size_per_gpu"] == 8
    assert resolved("zero2_offload", 2)["train_micro_batch_size_per_gpu"] == 32


def test_strategy_blocks_per_recipe():
    built = {name: builder.build(load_recipe(name)[0]) for name in recipe_names()}
    # tensor parallel is the harness's own layers (with an mpu), never DeepSpeed's AutoTP: one way, not two
    assert not any("tensor_parallel" in ds for ds in built.values())
    assert built["3d"]["pipeline"]["stages"] == 2 and built["pipeline"]["pipeline"]["stages"] == 2
    for name in ("3d", "pipeline", "tp"):
        assert built[name]["zero_optimization"]["stage"] <= 1
    nvme = built["zero3_nvme"]
    assert nvme["aio"] == builder.AIO_DEFAULTS
    for block in ("offload_optimizer", "offload_param"):
        assert nvme["zero_optimization"][block]["device"] == "nvme"
        assert nvme["zero_optimization"][block]["nvme_path"]
    assert "aio" not in built["zero3_offload"]
    assert built["zero3"]["zero_optimization"]["stage3_prefetch_bucket_size"] == "auto"
    assert "allgather_bucket_size" not in built["zero3"]["zero_optimization"]
    assert built["ddp"]["zero_optimization"] == {"stage": 0}


def test_builder_keeps_what_deepspeed_would_ignore_so_rules_can_report_it():
    recipe = complete({"description": "x", "zero": {"stage": 0, "offload_optimizer": "cpu"}}, "x")
    assert builder.build(recipe)["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


def test_scheduler_follows_the_run_length():
    short = complete({"description": "x"}, "x", ["train.steps=5"])
    params = builder.build(short)["scheduler"]["params"]
    assert params["warmup_num_steps"] == 5 and params["total_num_steps"] == 6  # ends after the last step
    assert params["warmup_max_lr"] == short["optimizer"]["lr"]
    assert "scheduler" not in builder.build(complete({"description": "x", "scheduler": {"type": "none"}}, "x"))
    cosine = builder.build(complete({"description": "x", "scheduler": {"type": "WarmupCosineLR"}}, "x"))
    assert cosine["scheduler"]["params"]["total_num_steps"] == 101


def test_raw_deepspeed_block_is_merged_last():
    recipe = complete({"description": "x", "zero": {"stage": 2},
                       "deepspeed": {"zero_optimization": {"reduce_bucket_size": 1000}, "steps_per_print": 7}}, "x")
    ds = builder.build(recipe)
    assert ds["zero_optimization"]["reduce_bucket_size"] == 1000
    assert ds["zero_optimization"]["stage"] == 2 and ds["steps_per_print"] == 7
