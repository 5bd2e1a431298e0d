"""Profiling hooks on a live DeepSpeed PipelineEngine vs the planner, per rank (4 CPU ranks, one launch).

bench/pipe_probe.py builds a tiny Llama-family PipelineModule (embedding, HF decoder layers, norm, tied head)
over pipeline 2 x tensor 2 (the harness's TP layers inside each stage) and trains it through train_batch with
the harness's hooks. One launch checks: DeepSpeed's layer split equals the planner's; each rank's model-state
bytes within 2 % of the planner's per-stage prediction; p2p send/recv (3D: 1/tp slices + partition meta), the
tp all-gathers that rebuild them, and all-reduce (TP + the stage's gradients) within 5 %; the measured bubble
beside (p-1)/(m+p-1); the report's pipeline section.
"""

from __future__ import annotations

import json

import pytest

from launch import launch

pytestmark = pytest.mark.multirank

STATE_RTOL, COMM_RTOL, SCALARS = 0.02, 0.05, 1024


@pytest.fixture(scope="module")
def run3d(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipe3d")
    launch("--out", str(out), "--pp", "2", "--tp", "2", "--layers", "3", "--tied", "--steps", "3",
           "--profile-steps", "2-3", ranks=4, script="bench/pipe_probe.py")
    return out, json.loads((out / "summary.json").read_text())


def test_stage_split_and_model_states_per_rank(run3d):
    _, summary = run3d
    assert summary["pipeline"]["parts_planned"] == summary["pipeline"]["parts_engine"] == summary["parts"]
    assert summary["pipeline"]["stage_per_rank"] == [0, 0, 1, 1]
    memory = summary["memory"]
    for rank, (measured, predicted) in enumerate(zip(memory["model_states_per_rank"],
                                                     memory["predicted_after_step_per_rank"])):
        got = sum(sum(d.values()) for d in measured.values())
        want = sum(sum(d.values()) for d in predicted.values())
        assert abs(got - want) <= STATE_RTOL * want, f"rank {rank}: model states {got} vs planner {want}"
        for term in ("params", "fp32_master", "optimizer_moments"):
            assert sum(measured[term].values()) == sum(predicted[term].values()), (rank, term)


def test_p2p_tp_and_gradient_bytes_per_rank(run3d):
    _, summary = run3d
    comm = summary["comm"]
    for rank, (measured, predicted) in enumerate(zip(comm["measured_per_rank"], comm["predicted_per_rank"])):
        assert {"send", "recv", "all_gather_into_tensor", "all_reduce"} <= set(predicted)
        for op, want in predicted.items():
            got = measured.get(op, 0)
            assert abs(got - want) <= COMM_RTOL * want, f"rank {rank} {op}: measured {got} vs planner {want}"
        unmodelled = {op: b for op, b in measured.items() if op not in predicted and b >= SCALARS}
        assert not unmodelled, f"rank {rank}: measured but not predicted {unmodelled}"
    groups = comm["predicted_by_group_per_rank"]
    assert groups[0]["tp"]["all_reduce"] == 2 * groups[2]["tp"]["all_reduce"]  # 2 blocks vs 1 on stage 1
    assert groups[0]["tied"]["all_reduce"] == 512 * 64 * 4 and groups[0]["pp"]["send"] == 4 * (2 * 32 * 64 * 4 // 2 + 72)


def test_bubble_and_report(run3d):
    out, summary = run3d
    pipe = summary["pipeline"]
    assert pipe["predicted_bubble"] == pytest.approx(1 / 5)
    assert all(0 <= b < 1 for b in pipe["measured_bubble_per_rank"])
    assert all({"ForwardPass", "BackwardPass"} <= set(ms) for ms in pipe["instruction_ms_per_rank"])
    report = (out / "report.md").read_text()
    assert "## Pipeline stages per rank" in report and "20.0% predicted" in report
    assert "not in the planner's model" not in report
