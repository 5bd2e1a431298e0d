"""`harness report`: tables, flags and plots from synthetic run folders (no ranks started)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.cli import main
from harness.errors import UsageError
from harness.report import compare_flags, load_run, write_report

MB = 1_000_000
PREDICTED_STATES = {"params": {"gpu": 200 * MB, "cpu": 0, "nvme": 0},
                    "fp32_master": {"gpu": 400 * MB, "cpu": 0, "nvme": 0},
                    "optimizer_moments": {"gpu": 800 * MB, "cpu": 0, "nvme": 0},
                    "grads": {"gpu": 0, "cpu": 0, "nvme": 0}}


def fake_run(folder: Path, *, stage=2, recipe="zero2", states=None, comm_scale=1.0, peak=3000 * MB,
             by_stage=None, steps=8) -> Path:
    """A finished 2-rank CUDA run folder shaped like harness/run.py's outputs."""
    folder.mkdir(parents=True)
    states = states or {"params": {"cuda": 200 * MB}, "fp32_master": {"cuda": 400 * MB},
                        "optimizer_moments": {"cuda": 800 * MB}, "other": {"cuda": 12}}
    comm = {"all_reduce": {"bytes": int(200 * MB * comm_scale), "count": 40, "latency_ms": 12.5},
            "all_gather_into_tensor": {"bytes": 100 * MB, "count": 1, "latency_ms": 3.0}}
    lines = []
    for step in range(1, steps + 1):
        record = {"kind": "train", "step": step, "time": 1000.0 + step, "loss": 5.0 - 0.1 * step, "lr": 1e-4,
                  "grad_norm": 1.0, "step_time_s": 0.5, "tokens_per_s": 30000.0 + step, "samples_per_s": 15.0,
                  "tflops_per_gpu": 300.0, "mfu": 0.3, "fwd_ms": 120.0, "bwd_ms": 300.0, "bwd_inner_ms": 250.0,
                  "bwd_allreduce_ms": 50.0, "step_ms": 60.0,
                  "memory": {"peak_allocated_bytes": peak, "peak_reserved_bytes": peak + MB, "allocated_bytes": MB}}
        if step in (5, 6):
            record.update(profiled=True, comm_per_rank=[comm, comm],
                          memory_per_rank=[record["memory"], record["memory"]], model_states_per_rank=[states, states])
        lines.append(json.dumps(record))
    lines.append(json.dumps({"kind": "eval", "step": steps, "time": 2000.0, "eval_loss": 4.2}))
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    predicted = {"after_step": PREDICTED_STATES, "peak_total_bytes": 3000 * MB,
                 "after_step_by_stage": by_stage or {"0": 2800 * MB, "1": 1600 * MB, "2": 1400 * MB, "3": 1400 * MB}}
    summary = {"recipe": recipe, "world_size": 2, "steps": steps, "first_loss": 4.9, "last_loss": 4.2,
               "profile": {"window": [5, 6]},
               "throughput": {"flops_per_token": 6e9, "tokens_per_s_median": 30000.0, "tflops_per_gpu": 300.0,
                              "mfu": 0.3, "device_name": "NVIDIA H200", "timers_ms_median": {"fwd": 120.0}},
               "comm": {"profiled_steps": [5, 6],
                        "measured_per_rank": [{k: v["bytes"] for k, v in comm.items()}] * 2,
                        "count_per_rank": [{k: v["count"] for k, v in comm.items()}] * 2,
                        "latency_ms_per_rank": [{k: v["latency_ms"] for k, v in comm.items()}] * 2,
                        "predicted": {"all_reduce": 200 * MB, "all_gather_into_tensor": 100 * MB}},
               "memory": {"device": "cuda", "peak_per_rank": [{"peak_allocated_bytes": peak}] * 2,
                          "model_states_per_rank": [states, states], "predicted": predicted}}
    (folder / "summary.json").write_text(json.dumps(summary))
    (folder / "recipe.json").write_text(json.dumps({"precision": "bf16", "train": {"model": "m", "seq_len": 2048}}))
    (folder / "ds_config.json").write_text(json.dumps({"zero_optimization": {"stage": stage}}))
    return folder


def test_report_within_tolerance_has_no_flags_and_all_plots(tmp_path):
    run_dir = fake_run(tmp_path / "z2")
    text = write_report(run_dir).read_text()
    report = json.loads((run_dir / "report.json").read_text())
    assert report["flags"] == []
    assert "MFU 30.0%" in text and "- none: every measured value is within tolerance" in text
    states = {r["term"]: r for r in report["tables"]["states"]}
    assert states["optimizer_moments"]["ratio"] == [1.0, 1.0] and states["other"]["flag"] == ""
    assert report["tables"]["peak"][0]["ratio"] == 1.0
    assert set(report["plots"]) == {"loss.png", "throughput.png", "memory.png", "comm.png", "step_time.png"}
    assert "predicted peak" in report["plots"]["memory.png"]
    assert all((run_dir / name).stat().st_size > 5000 for name in report["plots"])


def test_off_prediction_and_zero3_above_zero2_are_flagged(tmp_path):
    bucket = {"params": {"cuda": 100 * MB}, "grads": {"cuda": 100 * MB}, "fp32_master": {"cuda": 400 * MB},
              "optimizer_moments": {"cuda": 800 * MB}, "reduce_buckets": {"cuda": 1000 * MB}}
    run_dir = fake_run(tmp_path / "z3", stage=3, recipe="zero3", states=bucket, comm_scale=1.1)
    write_report(run_dir)
    flags = json.loads((run_dir / "report.json").read_text())["flags"]
    assert "comm, all_reduce: off by +10.0%" in flags
    assert "model states, reduce_buckets: not in the planner's model" in flags
    assert any(f.startswith("ZeRO-3 holds 2.40 GB of model states per rank, more than ZeRO-2 would (1.40 GB")
               for f in flags), flags


def test_runs_compared_flag_a_higher_stage_peaking_higher(tmp_path):
    z2 = fake_run(tmp_path / "z2", peak=2000 * MB)
    z3 = fake_run(tmp_path / "z3", stage=3, recipe="zero3", peak=3500 * MB)
    flags = compare_flags([load_run(z2), load_run(z3)])
    assert flags == ["ZeRO-3 (zero3 (z3)) peaks at 3.50 GB, above ZeRO-2 (zero2 (z2)) at 2.00 GB"]
    assert main(["report", str(z2), str(z3)]) == 0
    assert "peaks at 3.50 GB, above ZeRO-2" in (z3 / "report.md").read_text()


def test_unfinished_run_still_renders(tmp_path):
    run_dir = fake_run(tmp_path / "crashed")
    (run_dir / "summary.json").unlink()
    text = write_report(run_dir).read_text()
    assert "no summary.json: the run did not finish" in text
    assert "loss.png" in json.loads((run_dir / "report.json").read_text())["plots"]


def test_not_a_run_folder(tmp_path, capsys):
    with pytest.raises(UsageError, match="no metrics.jsonl here"):
        load_run(tmp_path)
    assert main(["report", str(tmp_path)]) == 2
    assert "fix: pass the folder a run wrote" in capsys.readouterr().err


def test_run_without_profiling_gets_loss_throughput_and_step_time_only(tmp_path):
    run_dir = tmp_path / "plain"
    run_dir.mkdir()
    records = [{"kind": "train", "step": s, "time": float(s), "loss": 3.0 / s, "lr": 1e-3, "grad_norm": None,
                "step_time_s": 0.1, "tokens_per_s": 5000.0, "samples_per_s": 10.0, "tflops_per_gpu": 0.01,
                "mfu": None} for s in range(1, 5)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run_dir / "summary.json").write_text(json.dumps({"recipe": "ddp", "world_size": 2, "profile": {"window": None},
                                                      "throughput": {"mfu": None, "mfu_note": "CPU"}}))
    text = write_report(run_dir).read_text()
    plots = json.loads((run_dir / "report.json").read_text())["plots"]
    assert set(plots) == {"loss.png", "throughput.png", "step_time.png"} and plots["step_time.png"] == ["step time"]
    assert "profiling window: off" in text and "not measured (no profile window)" in text


def test_pipeline_run_compares_each_rank_with_its_own_stage(tmp_path):
    """Two stages: the ranks' p2p and gradient predictions differ; each is compared with its own, the pipeline
    section sets send/recv and the bubble beside the measured ones, and a planned split unlike the engine's
    is flagged."""
    run_dir = fake_run(tmp_path / "pipe", stage=1, recipe="pipeline")
    summary = json.loads((run_dir / "summary.json").read_text())
    own = [{"all_reduce": 200 * MB, "send": 4 * MB, "recv": 4 * MB},
           {"all_reduce": 100 * MB, "send": 4 * MB, "recv": 4 * MB}]
    summary["comm"].update(measured_per_rank=[dict(p, broadcast=8) for p in own], predicted=own[0],
                           predicted_per_rank=own, count_per_rank=[{}, {}], latency_ms_per_rank=[{}, {}],
                           predicted_by_group_per_rank=[{"pp": {"send": 4 * MB, "recv": 4 * MB}, "tp": {}},
                                                        {"pp": {"send": 4 * MB, "recv": 4 * MB}, "tp": {}}])
    summary["pipeline"] = {"pp": 2, "micro_batches": 4, "predicted_bubble": 0.2, "parts_planned": [0, 3, 6],
                           "parts_engine": [0, 4, 6], "stage_per_rank": [0, 1],
                           "measured_bubble_per_rank": [0.25, 0.31], "instruction_ms_per_rank": [{}, {}]}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    text = write_report(run_dir).read_text()
    report = json.loads((run_dir / "report.json").read_text())
    reduce = next(r for r in report["tables"]["comm"] if r["collective"] == "all_reduce")
    assert reduce["ratio"] == [1.0, 1.0] and reduce["flag"] == ""
    assert "| all_reduce | 200.00 MB / 100.00 MB |" in text
    summary["memory"]["predicted_after_step_per_rank"] = [PREDICTED_STATES, {**PREDICTED_STATES, "params": {"gpu": 100 * MB}}]
    (run_dir / "summary.json").write_text(json.dumps(summary))
    text = write_report(run_dir).read_text()
    assert "| params | 200.00 MB / 100.00 MB | 200.00 MB | 200.00 MB | 1.000 / 2.000 |" in text  # each rank's own
    assert [r["bubble_measured"] for r in report["tables"]["pipeline"]] == [0.25, 0.31]
    assert "## Pipeline stages per rank" in text and "| 1 | 1 | 4.00 MB | 4.00 MB |" in text
    assert "31.0%" in text and "20.0% predicted" in text
    assert any(f.startswith("pipeline: the planner split the layers [0, 3, 6], the engine [0, 4, 6]")
               for f in report["flags"])


def test_cpu_peak_is_the_memory_in_use_above_each_ranks_baseline_against_its_own_prediction(tmp_path):
    """CPU ranks: peak_in_use_bytes (RssAnon less malloc's free bytes) less the rank's RssAnon before the build,
    beside that rank's own predicted peak; a prediction too small to tell from the process's drift is not
    compared."""
    run_dir = fake_run(tmp_path / "cpu")
    summary = json.loads((run_dir / "summary.json").read_text())
    base = 250 * MB
    summary["memory"].update(device="cpu", predicted_peak_total_per_rank=[1000 * MB, 1000 * MB],
                             peak_per_rank=[{"peak_in_use_bytes": base + 1000 * MB, "peak_rss_anon_bytes": 9 * base},
                                            {"peak_in_use_bytes": base + 1400 * MB}])
    summary["startup"] = {"per_rank": [{"build": {"rss_anon_before_bytes": base}}] * 2}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    write_report(run_dir)
    report = json.loads((run_dir / "report.json").read_text())
    rows = report["tables"]["peak"]
    assert [r["ratio"] for r in rows] == [1.0, 1.4] and rows[0]["measured"] == 1000 * MB
    assert "peak memory, rank 1: off by +40.0%" in report["flags"], report["flags"]
    summary["memory"]["predicted_peak_total_per_rank"] = [100 * MB, 100 * MB]
    (run_dir / "summary.json").write_text(json.dumps(summary))
    write_report(run_dir)
    report = json.loads((run_dir / "report.json").read_text())
    assert [r["ratio"] for r in report["tables"]["peak"]] == [None, None]
    assert "process's own drift" in report["tables"]["peak"][0]["flag"] and not any(
        f.startswith("peak memory") for f in report["flags"])
