"""The long-context rung with the model states offloaded (issue #31), held against what was run: ALST (Arctic Long
Sequence Training, arXiv 2506.13996) trains Llama-3.1-8B on 500K tokens on one H100 80GB (ZeRO-3, optimizer and
parameters in CPU RAM, tiled MLP and loss, activation checkpoints in CPU RAM) and 3.7M tokens on 8 H100s in one
node; and the planner's own 2-rank CPU runs (bench/long_context.py --part memory and --part longest). Arithmetic
only: no ranks."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from harness.model_shapes import KNOWN, PRESETS
from harness.planner import hardware, plan
from harness.planner.inputs import Cluster, Workload

GB, MIB = 10**9, 2**20
ALST_ONE_GPU, ALST_ONE_NODE = 500_000, 3_700_000  # tokens, Llama-3.1-8B on H100 80GB
# bench/long_context.py --part memory on 2 CPU ranks (ZeRO-3, fp32, micro-batch 1, document packing, checkpointing
# on): (seq_len, sp, tiled) -> MiB of training peak above the built engine, the larger rank
MEASURED_MIB = {(2048, 1, False): 41.0, (4096, 2, True): 93.9, (8192, 1, False): 393.7, (16384, 1, False): 1432.6,
                (16384, 2, True): 1317.9}
# --part longest, sp 1 untiled under a 256 MiB cap: 6,144 tokens fit (237 MiB), 7,168 did not (308 MiB)
CAP_MIB, LONGEST_FITS, FIRST_OVER = 256, 6144, 7168


@pytest.fixture(scope="module")
def bench():
    """bench/long_context.py, whose helpers give the measured runs' --set overrides and the planner's longest."""
    path = Path(__file__).resolve().parent.parent / "bench" / "long_context.py"
    spec = importlib.util.spec_from_file_location("bench_long_context", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def llama8b_plan(gpus: int, seq_len: int):
    return plan(KNOWN["llama-3.1-8b"], Cluster(gpus_per_node=gpus, gpu_mem_bytes=80 * GB), Workload(seq_len=seq_len),
                model_name="llama-3.1-8b", hardware_profile=hardware.load("h100-80gb-sxm"))


def harness_problems(result: dict, world: int) -> list:
    """What the harness's own checks say of a layout's --set overrides (config rules, then the sequence rules
    before_init applies on a GPU machine)."""
    from harness.config.recipes import load_recipe
    from harness.config.validate import check_recipe, context
    from harness.model.sequence import rules
    from harness.train.auto_recipe import _literal

    cfg = KNOWN["llama-3.1-8b"]
    sets = [f"{k}={_literal(v)}" for k, v in result["overrides"].items()] + ["train.model=llama-3.1-8b"]
    recipe, source = load_recipe(result["recipe"], sets)
    check_recipe(recipe, context(recipe, world, model_config=cfg), source)  # raises ConfigError when refused
    return rules.problems(recipe, cfg, recipe["parallel"]["sequence"], world, 1, 1, True)


def test_one_h100_holds_alsts_500k_with_optimizer_and_params_in_cpu_ram():
    p = llama8b_plan(1, ALST_ONE_GPU)
    rec = p.recommended
    assert rec is not None and rec["fits"], p.missing
    assert (rec["offload_optimizer"], rec["offload_param"], rec["tiled"], rec["act"]) == ("cpu", "cpu", True, "offload")
    assert rec["label"] == "zero3 opt->cpu params->cpu tiled ckpt->cpu" and rec["recipe"] == "zero3_offload"
    assert ALST_ONE_GPU / 2 <= rec["max_seq_len"] <= 2 * ALST_ONE_GPU  # 716K
    assert max(c["max_seq_len"] for c in p.candidates) == rec["max_seq_len"]
    assert harness_problems(rec, 1) == []
    # without the optimizer and parameters offloaded, ZeRO-3 over one GPU keeps ~132 GB of model states there
    unoffloaded = next(c for c in p.candidates if c["label"] == "zero3 tiled ckpt->cpu")
    assert not unoffloaded["fits"] and unoffloaded["max_seq_len"] == 0


def test_eight_h100s_hold_alsts_3_7m_within_2x_and_the_harness_accepts_the_offloaded_rows():
    p = llama8b_plan(8, ALST_ONE_NODE)
    longest = max(p.candidates, key=lambda c: c["max_seq_len"])
    assert ALST_ONE_NODE / 2 <= longest["max_seq_len"] <= 2 * ALST_ONE_NODE  # 5.23M
    assert longest["label"] == "zero3 opt->cpu params->cpu sp8 tiled ckpt->cpu"
    assert p.recommended["label"] == "zero3 sp8 tiled ckpt->cpu"  # 3.87M: the states need not leave the GPU
    offloaded = [c for c in p.candidates if c["act"] and c["offload_param"] == "cpu"]
    assert {c["sp"] for c in offloaded} == {1, 2, 4, 8}
    assert all(harness_problems(c, 8) == [] for c in offloaded)


def test_nvme_rows_join_the_rung_only_with_nvme_and_count_its_room():
    cfg = KNOWN["llama-3.1-8b"]
    rows = lambda nvme: [c for c in plan(cfg, Cluster(gpus_per_node=1, gpu_mem_bytes=80 * GB, nvme_bytes=nvme),  # noqa: E731
                                         Workload(seq_len=ALST_ONE_GPU)).candidates
                         if c["act"] and c["offload_param"] == "nvme"]
    assert rows(None) == []
    roomy, tight = rows(2000 * GB), rows(50 * GB)
    assert [c["label"] for c in roomy][-1] == "zero3 opt->nvme params->nvme tiled ckpt->cpu" and roomy[-1]["fits"]
    assert roomy[-1]["max_seq_len"] >= ALST_ONE_GPU and all(c["max_seq_len"] == 0 for c in tight)


def test_activation_predictions_hold_the_two_rank_cpu_measurements(bench):
    """The run's prediction (planner.evaluate with the live facts, as the memory part compares it): the planner's peak less the
    model states that exist by then (its after-step states), within 15 % of the measured peak above the engine."""
    from harness.config.recipes import load_recipe
    from harness.config.validate import check_recipe, context, strip_annotations
    from harness.config.run_model import RunModel
    from harness.planner import evaluate
    from harness.planner.params import count_params
    from harness.planner.rank import LiveFacts

    cfg = dict(PRESETS["tiny-llama"], max_position_embeddings=bench.POSITIONS)
    count = count_params(cfg)
    for (seq, sp, tiled), measured in MEASURED_MIB.items():
        recipe, source = load_recipe("zero3", bench.config_sets(seq, True, sp, tiled) + ["train.model=tiny-llama"])
        ds = strip_annotations(check_recipe(recipe, context(recipe, 2, model_config=cfg), source).ds_config)
        threshold = ds["zero_optimization"]["stage3_param_persistence_threshold"]
        live = LiveFacts(total=count.total, largest_layer=count.largest_layer, largest_tensor=count.largest_tensor,
                         persistent=count.persistent_numel(threshold))
        out = evaluate(RunModel.from_resolved(recipe, ds, 2, cfg), live=live).rank
        states = sum(sum(terms.values()) for terms in out["after_step"].values())
        predicted = (out["peak_total_bytes"] - states) / MIB
        assert abs(measured / predicted - 1) <= bench.PEAK_TOL, (seq, sp, tiled, measured, predicted)


def test_longest_under_a_cap_lies_in_the_measured_bracket(bench, tmp_path):
    cfg = dict(PRESETS["tiny-llama"], max_position_embeddings=bench.POSITIONS)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert LONGEST_FITS <= bench.planner_longest(str(tmp_path), CAP_MIB * MIB, True, 1, False) <= FIRST_OVER  # 6,386
