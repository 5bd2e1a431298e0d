"""Profiling hooks: unit checks of the pieces, then real 2-rank ZeRO-2 and ZeRO-3 runs on CPU whose
measured comm bytes and model-state bytes are held against the planner (5 % and 2 %).

Two runs sharing one launch check everything multi-rank: records of both ranks on the profiled steps only,
the planner comparison, timers and MFU fields, the CSV monitor with the harness's loss, and the report.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from harness.config.run_model import Zero
from harness.errors import UsageError
from harness.model_shapes import PRESETS
from harness.planner import comm as planner_comm, memory as planner_memory
from harness.planner.params import count_params
from harness.profiling import ds_overrides, parse_window
from harness.profiling.comm import per_step_mean, summarize
from harness.profiling.flops import flops_per_token, peak_tflops
from harness.profiling.memory import _Counter, nvme_swap_bytes, with_nvme
from harness.profiling.ranks import in_window

COMM_TOL, STATE_TOL = 0.05, 0.02
TINY = count_params(PRESETS["tiny-llama"])
HIDDEN = PRESETS["tiny-llama"]["hidden_size"]


def spec_with(profile_steps="3-4", csv=False, tensorboard=False):
    recipe = {"profile": {"steps": profile_steps, "memory": True}, "monitor": {"csv": csv, "tensorboard": tensorboard}}
    return SimpleNamespace(recipe=recipe)


# ---------------------------------------------------------------- unit: window, overrides, comm, flops

def test_window_counts_logged_steps_and_rejects_bad_ranges():
    assert parse_window("5-8") == (5, 8) and parse_window("") is None and parse_window(None) is None
    window = (5, 8)
    assert [s for s in range(12) if in_window(s, window)] == [4, 5, 6, 7]  # 0-based loop index -> logged 5..8
    with pytest.raises(UsageError, match=r"need 1 <= A <= B"):
        parse_window("8-5")
    with pytest.raises(UsageError, match=r"expected A-B"):
        parse_window("5")


def test_overrides_only_with_a_window(tmp_path):
    on = ds_overrides(spec_with("3-4", csv=True), tmp_path)
    assert on["comms_logger"]["enabled"] is True and on["wall_clock_breakdown"] is True
    assert on["csv_monitor"] == {"enabled": True, "output_path": str(tmp_path / "monitor"), "job_name": "csv"}
    off = ds_overrides(spec_with(""), tmp_path)
    assert off == {}  # DeepSpeed turns the comms logger on whenever the key is present


def test_tensorboard_without_its_package_is_a_usage_error(tmp_path):
    pytest.importorskip("deepspeed")
    try:
        import tensorboard  # noqa: F401
        pytest.skip("tensorboard is installed here")
    except ImportError:
        pass
    with pytest.raises(UsageError, match="pip install tensorboard"):
        ds_overrides(spec_with(tensorboard=True), tmp_path)


def test_comm_summary_from_raw_logger_data():
    raw = {"all_reduce": {1024: [3, [1.0, 2.0, 3.0], [0], [0]], 8: [1, [3.5], [0], [0]]},
           "all_gather_into_tensor": {512: [2, [0.5, 1.0], [0], [0]]}}
    got = summarize(raw, {"all_reduce": 4.25})
    assert got["all_reduce"] == {"bytes": 3 * 1024 + 8, "count": 4, "latency_ms": 4.25}
    assert got["all_gather_into_tensor"]["bytes"] == 1024
    assert got["all_gather_into_tensor"]["latency_ms"] == 1.0  # running totals: the last one is the sum
    steps = [got, {"all_reduce": {"bytes": 10, "count": 1, "latency_ms": 1.0}}]
    assert per_step_mean(steps, "bytes") == {"all_gather_into_tensor": 512.0, "all_reduce": (3080 + 10) / 2}


def test_flops_and_peaks():
    from harness.planner.params import model_shape

    shape = model_shape(dict(PRESETS["tiny-llama"]))
    # untied head: the token table is a lookup (left out), the head a matmul (kept)
    matmul = TINY.total - 512 * 64
    assert flops_per_token(TINY.total, shape, 64) == 6 * matmul + 12 * 2 * 64 * 64
    assert peak_tflops("NVIDIA H200", "bf16") == (989.4, None)
    assert peak_tflops("NVIDIA H100 PCIe", "bf16")[0] == 756.5
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16")[0] == 989.4
    peak, note = peak_tflops("cpu", "bf16")
    assert peak is None and "not meaningful on CPU" in note
    assert "unknown device" in peak_tflops("Some GPU 9000", "bf16")[1]


class FakeZeroOptimizer:  # the walker descends into deepspeed objects only
    __module__ = "deepspeed.runtime.zero.fake"


def test_counter_counts_each_storage_once_and_classifies_by_attribute():
    import torch

    flat = torch.zeros(100, dtype=torch.bfloat16)
    c = _Counter(torch.bfloat16)
    c.add("params", flat[:50])
    c.add("params", flat[50:])  # a view into the same flat buffer: counted once, whole
    c.add("grads", torch.zeros(10, device="meta"))  # no memory
    c.add("optimizer_moments", torch.zeros(()))  # Adam's step: bookkeeping
    opt = FakeZeroOptimizer()
    opt.ipg_buckets = {torch.bfloat16: [torch.zeros(64, dtype=torch.bfloat16)]}
    opt.grads_in_partition = torch.zeros(20, dtype=torch.float32)
    opt.temp_grad_buffer_for_cpu_offload = torch.zeros(32, dtype=torch.bfloat16)
    opt.single_partition_of_fp32_groups = [flat]  # already counted as params: not again
    c.walk(opt, "optimizer")
    assert c.bytes == {"params": {"cpu": 200}, "other": {"cpu": 4}, "reduce_buckets": {"cpu": 128},
                       "fp32_grads": {"cpu": 80}, "offload_buffers": {"cpu": 64}}


def test_nvme_swap_files_of_this_rank(tmp_path):
    for rank in (0, 1):
        params = tmp_path / "zero_stage_3" / "bfloat16params" / f"rank{rank}"
        optim = tmp_path / "zero_stage_3" / "optimizer" / f"rank{rank}"
        params.mkdir(parents=True)
        optim.mkdir(parents=True)
        (params / "0_param.tensor.swp").write_bytes(b"x" * 100)
        (optim / "0.tensor.swp").write_bytes(b"x" * (300 + rank))
    ds = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)},
                                "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}}
    assert nvme_swap_bytes(ds, 1) == {"params": 100, "optimizer": 301}
    assert nvme_swap_bytes({"zero_optimization": {"stage": 2}}, 0) == {}
    states = with_nvme({"params": {"cpu": 5}}, {"params": 100, "optimizer": 301})
    assert states == {"params": {"cpu": 5, "nvme": 100}, "optimizer_moments": {"nvme": 301}}


# ---------------------------------------------------------------- multi-rank: real runs

def planner_states(stage: int, optimizer_states: int = 2) -> dict[str, int]:
    buckets = planner_memory.harness_buckets(HIDDEN)
    persistent = TINY.persistent_numel(buckets.param_persistence_threshold) if stage == 3 else 0
    held = planner_memory.Holding(TINY.total, TINY.largest_layer, TINY.largest_tensor, persistent,
                                  optimizer_states=optimizer_states)
    terms = planner_memory.model_state_bytes(held, Zero(stage, buckets=buckets), zero_shards=2, precision="bf16",
                                             phase="after_step")
    return {term: sum(devices.values()) for term, devices in terms.items() if sum(devices.values())}


def planner_comm_bytes(stage: int) -> dict[str, int]:
    persistent = TINY.persistent_numel(10 * HIDDEN) if stage == 3 else 0
    # A model this small stays gathered between forward and backward (deepspeed-facts.md): one gather.
    return planner_comm.comm_bytes_per_step(TINY.total, stage=stage, zero_shards=2, precision="bf16",
                                            persistent_params=persistent, gathers_per_micro_step=1)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """A zero2 and a zero3 run, and zero2 with plain SGD (no optimizer state), all in ONE launch
    (tests/drivers/jobs.py)."""
    from helpers.launch import launch_jobs

    out = {recipe: tmp_path_factory.mktemp(recipe) for recipe in ("zero2", "zero3", "zero2_sgd")}
    launch_jobs([["--recipe", recipe.removesuffix("_sgd"), "--set", "train.steps=6", "--set", "train.seq_len=64",
                  "--profile-steps", "3-4", "--set", "monitor.csv=true", "--set", "train.eval_every=0",
                  "--output-dir", str(run_dir), "--overwrite",
                  *(["--set", "optimizer.type=sgd"] if recipe.endswith("_sgd") else [])]
                 for recipe, run_dir in out.items()], tmp_path_factory.mktemp("jobs"))
    return out


def train_records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "train"]


def measured_terms(states: dict) -> dict[str, int]:
    return {term: sum(devices.values()) for term, devices in states.items()}


@pytest.mark.multirank
@pytest.mark.parametrize("recipe", ["zero2", "zero3"])
def test_profiled_steps_hold_both_ranks(runs, recipe):
    records = train_records(runs[recipe])
    assert [r["step"] for r in records if r.get("profiled")] == [3, 4]
    for r in records:
        assert r["memory"]["peak_rss_bytes"] >= r["memory"]["rss_bytes"] > 0
        assert r["mfu"] is None and r["tflops_per_gpu"] > 0
        assert {"fwd_ms", "bwd_ms", "step_ms"} <= set(r), f"DeepSpeed timers missing in step {r['step']}"
        if not r.get("profiled"):
            assert "comm_per_rank" not in r and "model_states_per_rank" not in r
    for r in (r for r in records if r.get("profiled")):
        assert len(r["comm_per_rank"]) == len(r["memory_per_rank"]) == len(r["model_states_per_rank"]) == 2
        for rank in r["comm_per_rank"]:
            assert all(v["count"] > 0 and v["bytes"] > 0 and v["latency_ms"] >= 0 for v in rank.values())
    summary = json.loads((runs[recipe] / "summary.json").read_text())
    assert summary["profile"]["window"] == [3, 4] and summary["comm"]["profiled_steps"] == [3, 4]
    assert summary["throughput"]["mfu"] is None and "not meaningful on CPU" in summary["throughput"]["mfu_note"]
    assert len(summary["memory"]["peak_per_rank"]) == 2 and summary["memory"]["model_states_step"] == 6


@pytest.mark.multirank
@pytest.mark.parametrize("recipe,stage", [("zero2", 2), ("zero3", 3)])
def test_comm_bytes_match_the_planner(runs, recipe, stage):
    predicted = planner_comm_bytes(stage)
    for record in (r for r in train_records(runs[recipe]) if r.get("profiled")):
        for rank, measured in enumerate(record["comm_per_rank"]):
            for op, nbytes in predicted.items():
                got = measured[op]["bytes"]
                assert abs(got / nbytes - 1) <= COMM_TOL, f"{recipe} rank {rank} step {record['step']} {op}: " \
                                                          f"measured {got} vs planner {nbytes}"
            unpredicted = {op: v["bytes"] for op, v in measured.items() if op not in predicted}
            assert all(b < 64 for b in unpredicted.values()), f"unexpected traffic {unpredicted}"  # norm scalars
    summary = json.loads((runs[recipe] / "summary.json").read_text())
    assert summary["comm"]["predicted"] == predicted  # the run's own prediction used the same inputs


@pytest.mark.multirank
@pytest.mark.parametrize("recipe,stage,bytes_per_param,states", [("zero2", 2, 8.0, 2), ("zero3", 3, None, 2),
                                                                   ("zero2_sgd", 2, 4.0, 0)])
def test_model_state_bytes_match_the_planner(runs, recipe, stage, bytes_per_param, states):
    """Adam keeps two fp32 moments per parameter, plain SGD none: the run's own prediction (summary.json) reads
    which from its DeepSpeed dict (config/run_model.optimizer_states)."""
    predicted = planner_states(stage, states)
    assert ("optimizer_moments" in predicted) == bool(states)
    summary = json.loads((runs[recipe] / "summary.json").read_text())
    per_rank = summary["memory"]["model_states_per_rank"]
    profiled = [s for r in train_records(runs[recipe]) if r.get("profiled") for s in r["model_states_per_rank"]]
    for rank, states in enumerate(per_rank + profiled):
        got = measured_terms(states)
        for term, nbytes in predicted.items():
            assert abs(got.get(term, 0) / nbytes - 1) <= STATE_TOL, f"{recipe} #{rank} {term}: {got} vs {predicted}"
        extra = {t: b for t, b in got.items() if t not in predicted}
        assert sum(extra.values()) < 1024, f"{recipe}: bytes the planner does not model: {extra}"
        if bytes_per_param:  # deepspeed-facts.md: ZeRO-1/2, bf16, N=2: 8.0 B/param
            assert abs(sum(got.values()) / TINY.total - bytes_per_param) / bytes_per_param <= STATE_TOL
    assert {k: sum(v.values()) for k, v in summary["memory"]["predicted"]["after_step"].items()
            if sum(v.values())} == predicted


@pytest.mark.multirank
def test_csv_monitor_has_the_harness_loss(runs):
    csv = runs["zero2"] / "monitor" / "csv" / "Train_Samples_train_loss.csv"
    rows = csv.read_text().splitlines()
    assert rows[0] == "step,train_loss" and len(rows) == 1 + 6
    first_loss = train_records(runs["zero2"])[0]["loss"]
    assert float(rows[1].split(",")[1]) == pytest.approx(first_loss)
    ds = json.loads((runs["zero2"] / "ds_config.json").read_text())
    assert "comms_logger" in ds and ds["csv_monitor"]["enabled"] is True


@pytest.mark.multirank
def test_report_renders_both_runs(runs):
    import matplotlib.image as mpimg

    from harness.cli import main

    assert main(["report", str(runs["zero2"]), str(runs["zero3"])]) == 0
    for recipe, ops in (("zero2", {"all_reduce", "all_gather_into_tensor"}),
                        ("zero3", {"reduce_scatter_tensor", "all_gather_into_tensor"})):
        run_dir = runs[recipe]
        text = (run_dir / "report.md").read_text()
        assert "## Model states per rank after a step" in text and "## Communication per step" in text
        report = json.loads((run_dir / "report.json").read_text())
        assert report["flags"] == [], f"{recipe}: unexpected flags {report['flags']}"
        assert ops <= {r["collective"] for r in report["tables"]["comm"]}
        expected = {"loss.png": {"train loss"}, "throughput.png": {"tokens/s", "profiled steps"},
                    "memory.png": {"params", "optimizer_moments", "rank 0 peak_rss", "rank 1 peak_rss (profiled)"},
                    "comm.png": {"predicted", "rank 0", "rank 1"},
                    "step_time.png": {"forward", "backward compute", "optimizer step", "step time"}}
        for name, series in expected.items():
            assert series <= set(report["plots"][name]), f"{recipe} {name}: {report['plots'][name]}"
            image = mpimg.imread(run_dir / name)
            assert image.ndim == 3 and image.shape[0] >= 300 and image.shape[1] >= 500
            assert image[..., :3].std() > 0.05, f"{name} looks blank"


@pytest.mark.multirank
@pytest.mark.nvme
def test_zero_infinity_swap_buffers_and_files_are_counted(nvme_runs):
    """The swap run of tests/helpers/nvme.py (its launch is shared with test_training's NVMe run)."""
    from helpers.nvme import SWAP_COUNT as swap_count, SWAP_ELEMS as swap_elems

    run_dir = nvme_runs / "swap"
    buckets = planner_memory.harness_buckets(HIDDEN)
    buckets = planner_memory.ZeroBuckets(**{**buckets.__dict__, "param_swap_buffer_elems": swap_elems,
                                            "param_swap_buffer_count": swap_count})
    held = planner_memory.Holding(TINY.total, TINY.largest_layer, TINY.largest_tensor,
                                  TINY.persistent_numel(buckets.param_persistence_threshold))
    predicted = planner_memory.model_state_bytes(held, Zero(3, "nvme", "nvme", buckets), zero_shards=2,
                                                 precision="bf16", phase="after_step")
    want = sum(predicted["offload_buffers"].values())  # pinned swap buffers of both swappers
    memory = json.loads((run_dir / "summary.json").read_text())["memory"]
    assert len(memory["nvme_swap_bytes_per_rank"]) == 2
    for states in memory["model_states_per_rank"]:
        got = sum(states["offload_buffers"].values())
        assert abs(got / want - 1) <= STATE_TOL, f"swap buffers {got} vs planner {want}"
        assert set(states["offload_buffers"]) == {"cpu"}


def test_measured_bubble_is_the_idle_share_of_the_pipe_schedule():
    """Forward/backward are the work; recv waits, sends and batch loading are idle; the optimizer step and the
    gradient reductions after the last micro-batch are outside the 1F1B schedule the bubble formula models."""
    from harness.profiling.pipe import measured_bubble

    ms = {"ForwardPass": 30.0, "BackwardPass": 50.0, "RecvGrad": 15.0, "SendActivation": 4.0,
          "LoadMicroBatch": 1.0, "OptimizerStep": 100.0, "ReduceGrads": 40.0, "ReduceTiedGrads": 5.0}
    assert measured_bubble(ms) == pytest.approx(0.2)
    assert measured_bubble({"OptimizerStep": 3.0}) is None
    assert ds_overrides(SimpleNamespace(**{**vars(spec_with("3-4")), "pp": 2}), "/tmp").get("wall_clock_breakdown") \
        is None  # the PipelineEngine's own timers crash with it in DeepSpeed 0.19.8
