"""bench/pipe_probe.py (what bench/gpu_check.sh's pipeline and 3D cases run on GPUs) on 2 CPU ranks.

The probe builds a tiny Llama-family PipelineModule (embedding, HF decoder layers, norm, tied head) and trains
it through train_batch with the harness's hooks, outside the trainer. One launch checks: DeepSpeed's layer
split equals the planner's; each rank's model-state bytes within 2 % of its stage's prediction; p2p send/recv,
the tied embedding's and the stage's gradient all-reduce within 5 %; the measured bubble beside (p-1)/(m+p-1);
the report's pipeline section. The harness's own pipeline and 3D launches make the same checks per rank
(tests/test_pipeline.py check_planner); `--tp 2` on 4 ranks gives the probe's 3D case.
"""

from __future__ import annotations

import json

import pytest

from helpers.launch import launch

pytestmark = pytest.mark.multirank

STATE_RTOL, COMM_RTOL, SCALARS = 0.02, 0.05, 1024


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipe")
    launch("--out", str(out), "--pp", "2", "--layers", "3", "--tied", "--steps", "3",
           "--profile-steps", "2-3", ranks=2, script="bench/pipe_probe.py")
    return out, json.loads((out / "summary.json").read_text())


def test_stage_split_and_model_states_per_rank(run):
    _, summary = run
    assert summary["pipeline"]["parts_planned"] == summary["pipeline"]["parts_engine"] == summary["parts"]
    assert summary["pipeline"]["stage_per_rank"] == [0, 1]
    memory = summary["memory"]
    for rank, (measured, predicted) in enumerate(zip(memory["model_states_per_rank"],
                                                     memory["predicted_after_step_per_rank"])):
        got = sum(sum(d.values()) for d in measured.values())
        want = sum(sum(d.values()) for d in predicted.values())
        assert abs(got - want) <= STATE_RTOL * want, f"rank {rank}: model states {got} vs planner {want}"
        for term in ("params", "fp32_master", "optimizer_moments"):
            assert sum(measured[term].values()) == sum(predicted[term].values()), (rank, term)


def test_p2p_tp_and_gradient_bytes_per_rank(run):
    _, summary = run
    comm = summary["comm"]
    for rank, (measured, predicted) in enumerate(zip(comm["measured_per_rank"], comm["predicted_per_rank"])):
        assert {"send", "recv", "all_reduce"} <= set(predicted)
        for op, want in predicted.items():
            got = measured.get(op, 0)
            assert abs(got - want) <= COMM_RTOL * want, f"rank {rank} {op}: measured {got} vs planner {want}"
        unmodelled = {op: b for op, b in measured.items() if op not in predicted and b >= SCALARS}
        assert not unmodelled, f"rank {rank}: measured but not predicted {unmodelled}"
    groups = comm["predicted_by_group_per_rank"]
    assert [g["tied"]["all_reduce"] for g in groups] == [512 * 64 * 4] * 2  # the embedding's fp32 gradient
    assert [g["pp"]["send"] for g in groups] == [4 * 2 * 32 * 64 * 4] * 2  # 4 micro-batches of 2 x 32 x 64
    assert groups[0]["dp"]["all_reduce"] == 4 * (512 * 64 + 2 * 46208)  # a group of one still all-reduces


def test_bubble_and_report(run):
    out, summary = run
    pipe = summary["pipeline"]
    assert pipe["predicted_bubble"] == pytest.approx(1 / 5)
    assert all(0 <= b < 1 for b in pipe["measured_bubble_per_rank"])
    assert all({"ForwardPass", "BackwardPass"} <= set(ms) for ms in pipe["instruction_ms_per_rank"])
    report = (out / "report.md").read_text()
    assert "## Pipeline stages per rank" in report and "20.0% predicted" in report
    assert "not in the planner's model" not in report
