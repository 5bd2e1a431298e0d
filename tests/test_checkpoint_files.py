"""Checkpoint bookkeeping on real folders, no ranks: which checkpoint a resume picks, retention, the batch kept
on another world size, and the refusals (exit 2 messages). The launches are in tests/test_reliability.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.config.recipes import load_recipe
from harness.errors import UsageError
from harness.checkpoint import files as ckpt_files
from harness.checkpoint import resume


def make(ckpt: Path, step: int, complete: bool = True, world: int = 2, batch: int = 8, shards: bool = True,
         **layout) -> Path:
    folder = ckpt / f"global_step{step}"
    folder.mkdir(parents=True)
    (folder / "mp_rank_00_model_states.pt").write_bytes(b"")
    if shards:
        (folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"")
    if complete:
        (folder / "manifest.json").write_text(json.dumps({
            "step": step, "world_size": world, "pp": 1, "tp": 1, "dp": world, "train_batch_size": batch,
            "micro_batch_per_gpu": 4, "grad_accum_steps": batch // (4 * world), "zero_stage": 2 if shards else 0,
            **layout}))
    return folder


def test_resume_picks_the_newest_complete_checkpoint_and_reports_interrupted_ones(tmp_path):
    ckpt = tmp_path / "run" / "checkpoints"
    for step in (2, 10):
        make(ckpt, step)
    make(ckpt, 11, complete=False)
    point = resume.find("latest", tmp_path / "run")
    assert (point.tag, point.step, point.skipped) == ("global_step10", 10, ("global_step11",))  # 10 > 2 numerically
    assert ckpt_files.later_tags(ckpt, 2) == ["global_step10"]  # the incomplete one is nothing to overwrite
    with pytest.raises(UsageError, match=r"incomplete checkpoint \(no manifest.json: its save was interrupted\)"):
        resume.find(str(ckpt / "global_step11"), tmp_path / "run")


def test_resume_with_only_incomplete_checkpoints_is_refused(tmp_path):
    make(tmp_path / "checkpoints", 3, complete=False)
    with pytest.raises(UsageError, match=r"no complete checkpoint .*only incomplete ones: global_step3"):
        resume.find("latest", tmp_path)


def test_retention_keeps_the_newest_complete_and_deletes_only_older(tmp_path):
    ckpt = tmp_path / "checkpoints"
    for step in (1, 2, 3, 4):
        make(ckpt, step)
    make(ckpt, 5, complete=False)  # a save in progress (or interrupted) is newer than every complete one
    (ckpt / "universal" / "global_step1").mkdir(parents=True)
    assert ckpt_files.prune(ckpt, 2) == ["global_step1", "global_step2"]
    assert ckpt_files.tags(ckpt) == ["global_step3", "global_step4", "global_step5"]
    assert not (ckpt / "universal" / "global_step1").exists()
    assert ckpt_files.prune(ckpt, 0) == [] and ckpt_files.prune(ckpt, 1) == ["global_step3"]


def test_another_world_size_keeps_the_global_batch_and_needs_the_universal_form(tmp_path):
    make(tmp_path, 4, world=2, batch=8)
    point = resume.find(str(tmp_path / "global_step4"), tmp_path)
    recipe, _ = load_recipe("zero2")
    overrides, note = resume.batch_overrides(point, recipe, batch_world=1)
    assert overrides == ["batch.train_batch_size=8", "batch.grad_accum_steps=2"]
    assert "global batch 8 kept from global_step4 (4 micro x 1 accum x 2 dp); here 4 micro x 2 accum x 1" in note
    assert resume.needs_universal(point, 1, 1, 1, 2) and not resume.needs_universal(point, 2, 1, 1, 1)
    with pytest.raises(UsageError, match=r"8 is not a multiple of micro 4 x 4 ranks = 16\n    fix: --set "
                                         r"batch.micro_batch_per_gpu=M with M dividing 2"):
        resume.batch_overrides(point, recipe, batch_world=4)
    pinned, _ = load_recipe("zero2", ["batch.train_batch_size=16"])
    with pytest.raises(UsageError, match=r"global batch 8, batch.train_batch_size asks 16.*\n    fix: --set "
                                         r"batch.train_batch_size=8"):
        resume.batch_overrides(point, pinned, batch_world=1)
    unsharded = resume.find(str(make(tmp_path / "z0", 2, shards=False)), tmp_path)
    assert not resume.needs_universal(unsharded, 1, 1, 1, 0)  # ZeRO-0 fp32: the whole optimizer state, any world


def test_a_recipe_pinning_the_same_global_batch_gets_its_accumulation_re_derived(tmp_path):
    """zero2_offload pins batch 256 with accum 4 for 8 ranks: on 4 ranks the accumulation must become 8."""
    point = resume.find(str(make(tmp_path, 5, world=8, batch=256)), tmp_path)
    recipe, _ = load_recipe("zero2_offload", ["batch.train_batch_size=256", "batch.micro_batch_per_gpu=8",
                                              "batch.grad_accum_steps=4"])
    overrides, note = resume.batch_overrides(point, recipe, batch_world=4)
    assert overrides == ["batch.train_batch_size=256", "batch.grad_accum_steps=8"] and "8 micro x 8 accum x 4" in note


def test_another_tensor_pipeline_degree_or_zero_partitioning_goes_through_the_universal_form(tmp_path):
    point = resume.find(str(make(tmp_path / "tp", 4, world=2, tp=2, dp=1, universal_patterns=1)), tmp_path)
    assert resume.needs_universal(point, 2, 1, 1, 2) and resume.needs_universal(point, 4, 2, 2, 1)
    assert not resume.needs_universal(point, 2, 1, 2, 1)  # ZeRO-1 and 2 share one format
    assert resume.needs_universal(point, 2, 1, 2, 3)  # ZeRO-3 partitions differently
    old = resume.find(str(make(tmp_path / "old", 4, world=2, tp=2, dp=1)), tmp_path)
    with pytest.raises(UsageError, match=r"written before the harness declared how its tensor-parallel layers split"
                                         r".*\n    fix: launch 2 ranks with pipeline 1, tensor 2, or `harness export"):
        resume.needs_universal(old, 2, 1, 1, 2)


def test_zero0_on_one_side_of_a_layout_change_goes_through_the_universal_form_where_fp32_without_tp_or_pp(tmp_path):
    """checkpoint/zero0.py writes and reads ZeRO-0's side of the universal form: fp32, pipeline 1, tensor 1."""
    plain = resume.find(str(make(tmp_path / "ddp", 4, world=2, shards=False, precision="fp32")), tmp_path)
    assert resume.needs_universal(plain, 2, 1, 1, 2) and resume.needs_universal(plain, 2, 2, 1, 1)  # -> zero2, pp2
    assert not resume.needs_universal(plain, 1, 1, 1, 0)  # ZeRO-0 to ZeRO-0: loads on any world as it is
    pipeline = resume.find(str(make(tmp_path / "pp", 4, world=2, pp=2, dp=1, zero_stage=1)), tmp_path)
    assert resume.needs_universal(pipeline, 2, 1, 1, 0)  # pipeline -> ddp
    with pytest.raises(UsageError, match=r"ZeRO-1; this launch is world 2 with pipeline 1, tensor 1, ZeRO-0: a layout "
                                         r"change with ZeRO-0 .* \(the launched side is pipeline 1, tensor 1, bf16\)\n"
                                         r"    fix: launch 2 ranks with pipeline 2, tensor 1 on ZeRO-1, or ZeRO-1 or "
                                         r"above on the launched side, or precision=fp32"):
        resume.needs_universal(pipeline, 2, 1, 1, 0, "bf16")
    zero0_pp = resume.find(str(make(tmp_path / "z0pp", 4, world=2, shards=False, pp=2, dp=1)), tmp_path)
    with pytest.raises(UsageError, match=r"the saved side is pipeline 2, tensor 1, fp32"):
        resume.needs_universal(zero0_pp, 2, 1, 1, 1)




def test_universal_slicing_patterns_say_what_the_tensor_parallel_table_says():
    """ds_to_universal joins tensor ranks by the patterns every save declares (checkpoint/relayout.py); they must
    classify every name as parallel/tensor.py's split_dim does, for HF, pipeline and LoRA names."""
    import re

    from harness.model.parallel.tensor import split_dim, universal_patterns

    replicated, row = universal_patterns()
    for prefix in ("model.layers.0.", "3.layer."):
        for block, name in [("self_attn", p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")] + \
                           [("mlp", p) for p in ("gate_proj", "up_proj", "down_proj")]:
            for tail in ("weight", "bias", "base_layer.weight", "base_layer.bias", "lora_A.default.weight",
                         "lora_B.default.weight"):
                key = f"{prefix}{block}.{name}.{tail}"
                got = None if re.match(replicated, key) else 1 if re.match(row, key) else 0
                assert got == split_dim(key), key
    for key in ("model.embed_tokens.weight", "lm_head.weight", "3.norm.weight", "tied_modules.embed.embed.weight"):
        assert re.match(replicated, key) and not re.match(row, key)


def test_pipeline_parameter_names_map_to_hf_names():
    from harness.checkpoint.relayout import hf_name

    partition = {"layers": [
        {"index": 0, "tied": "embed", "hf_names": {"embed.weight": "model.embed_tokens.weight"}},
        {"index": 1, "tied": None, "hf_names": {"layer.mlp.up_proj.weight": "model.layers.0.mlp.up_proj.weight"}},
        {"index": 2, "tied": "embed", "hf_names": {}}]}
    assert hf_name("1.layer.mlp.up_proj.weight", partition) == "model.layers.0.mlp.up_proj.weight"
    assert hf_name("1.layer.mlp.up_proj.lora_A.default.weight", partition) == \
        "model.layers.0.mlp.up_proj.lora_A.default.weight"  # a key the partition does not list: its sibling's prefix
    assert hf_name("tied_modules.embed.embed.weight", partition) == "model.embed_tokens.weight"
    assert hf_name("model.norm.weight", None) == "model.norm.weight"


def test_another_expert_degree_goes_through_the_universal_form_but_not_with_zero0_or_lora(tmp_path):
    """ZeRO-1/2/3 on both sides converts (ep2 -> ep1 on ZeRO-3 runs in tests/test_relayout.py); ZeRO-0 and LoRA exit 2
    before any rank starts."""
    ds = {"zero_optimization": {"stage": 3}, "expert_parallel": {"enabled": False}}
    point = resume.find(str(make(tmp_path / "ep", 4, ep=2, zero_stage=3)), tmp_path)
    assert resume.check_expert(point, ds) and not resume.check_expert(point, {**ds, "expert_parallel": {
        "enabled": True, "autoep_size": 2}})
    lora = resume.find(str(make(tmp_path / "lora", 4, ep=2, adapter={"type": "lora"})), tmp_path)
    with pytest.raises(UsageError, match=r"parallel.expert=2 \(ZeRO-2\), this launch asks parallel.expert=1 "
                                         r"\(ZeRO-3\).*\(LoRA here\)\n    fix: --set parallel.expert=2"):
        resume.check_expert(lora, ds)
    with pytest.raises(UsageError, match=r"\(ZeRO-0 here\)"):
        resume.check_expert(point, {"zero_optimization": {"stage": 0}})
