"""`harness calibrate` on this machine (2 CPU ranks over gloo), the profile it writes used by `plan`, by a run
that records its predicted step time beside the measured one, and by `--recipe auto`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers.launch import ROOT, env, launch
from helpers.plan import run_plan

from harness.planner import hardware
from harness.report import write_report


@pytest.mark.multirank
def test_calibrate_then_auto_run_records_predicted_and_measured_step_time(tmp_path, monkeypatch, capsys):
    out = tmp_path / "hw.json"
    proc = subprocess.run([sys.executable, "-m", "harness.cli", "calibrate", "--out", str(out), "--model", "tiny-llama",
                           "--seq-len", "64", "--ranks", "2", "--nvme-path", str(tmp_path)],
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    profile = hardware.load(str(out))  # schema-checked
    m = profile["measured"]
    assert profile["device"] == "cpu" and profile["comm_overlap"] is False and m["backend"] == "gloo"
    assert all(m["bus_gbps"][op]["2"] > 0 for op in ("all_reduce", "all_gather", "reduce_scatter"))
    for op in ("all_reduce", "all_gather", "reduce_scatter"):  # seconds per call against the message size
        curve = {int(b): t for b, t in m["seconds_by_bytes"][op]["2"].items()}
        assert len(curve) >= 4 and all(t > 0 for t in curve.values()) and curve[max(curve)] > curve[min(curve)]
    # a real DeepSpeed engine stepped at every ZeRO stage on both ranks at once
    assert set(m["engine"]["stages"]) == {"0", "1", "2", "3", "2-offload"} and m["engine"]["params"] > 0
    assert all(t["fwd_bwd_s"] > 0 and t["step_s"] > 0 for t in m["engine"]["stages"].values())
    assert set(m["optimizer_params_per_s"]) == {"0", "1", "2", "3", "2-offload"} and min(m["optimizer_params_per_s"].values()) > 0
    assert set(m["zero_overhead_s_per_tensor"]) == {"1", "2", "3"}
    assert m["gemm"]["tflops"] > 0 and profile["peak_tflops"]["bf16"] == m["gemm"]["tflops"]
    assert profile["cpu_adam_params_per_s"] > 0 and "n/a on the CPU accelerator" in m["host_copy"]["note"]
    assert ("read_gbps" in m["nvme"]) or ("async_io does not load" in m["nvme"]["error"])
    assert not list(tmp_path.glob("harness-calibrate-*"))  # the NVMe probe file is removed

    code, text = run_plan(["--model", "tiny-llama", "--gpus", "2", "--hardware", str(out), "--zero", "2", "--json"],
                          capsys)
    evaluated = json.loads(text)["evaluated"]
    assert evaluated["time"]["step_time_s"] > 0 and evaluated["time"]["breakdown"]["dp_reduce_exposed_s"] > 0

    monkeypatch.setenv("HARNESS_HARDWARE", str(out))
    run = tmp_path / "run"
    proc = launch("--recipe", "auto", "--output-dir", str(run), "--set", "train.steps=4", "--set", "train.eval_every=0")
    assert "predicted" in proc.stdout and "s/step on $HARNESS_HARDWARE" in proc.stdout
    st = json.loads((run / "summary.json").read_text())["throughput"]["step_time"]
    assert st["profile"] == "calibrated" and st["step_time_s"] > 0 and len(st["measured_median_s_per_rank"]) == 2
    assert st["ratio"] == pytest.approx(max(st["measured_median_s_per_rank"]) / st["step_time_s"], rel=0.5)
    report = write_report(run).read_text()
    assert "## Step time (predicted vs measured)" in report and "profile **calibrated**" in report


def test_calibrate_link_refuses_what_it_cannot_measure(tmp_path, capsys):
    """--link needs node 0's address and a node profile to add the link to; it says which, before any process
    starts (tests/test_two_hosts.py measures a real wire)."""
    from harness.cli import main

    assert main(["calibrate", "--link", "--out", str(tmp_path / "p.json")]) == 2
    assert "--link needs --master-addr" in capsys.readouterr().err
    assert main(["calibrate", "--link", "--master-addr", "127.0.0.1", "--node-rank", "2"]) == 2
    assert "--nnodes 2 --node-rank 2" in capsys.readouterr().err
    assert main(["calibrate", "--link", "--master-addr", "127.0.0.1", "--base", str(tmp_path / "none.json"),
                 "--out", str(tmp_path / "p.json")]) == 2
    assert f"{tmp_path / 'none.json'} does not exist: run `harness calibrate` on this node first" \
        in capsys.readouterr().err


def test_hook_overhead_from_interleaved_fastest_steps_is_stable_and_never_negative():
    """The ZeRO hook overhead (calibration/hooks.py) on given step times, no timing: stage 0 timed alone while
    another job ran, ZeRO-2's steps each right after a stage-0 step later, with one disturbed step. The true
    overhead here is 20 ms over 10 tensors = 2 ms per tensor."""
    import statistics

    from harness.calibration.hooks import hook_overhead

    base = {"fwd_bwd_samples_s": [0.50, 0.52, 0.49, 0.51, 0.55, 0.50, 0.53, 0.52]}  # loaded machine
    stage2 = {"fwd_bwd_samples_s": [0.43, 0.42, 0.50, 0.45, 0.44],
              "base_fwd_bwd_samples_s": [0.41, 0.40, 0.47, 0.43, 0.42]}
    old = (statistics.median(stage2["fwd_bwd_samples_s"]) - statistics.median(base["fwd_bwd_samples_s"])) / 10
    assert old == pytest.approx(-0.0075)  # the difference of medians timed apart: impossible
    value, why = hook_overhead(stage2, base, 0.0, 0.0, 10)
    assert value == pytest.approx(0.002) and "clamped" not in why
    assert why["pair_differences_ms"] == [20.0, 20.0, 30.0, 20.0, 20.0]
    # the collectives the time model prices apart come off each side
    assert hook_overhead(stage2, base, 0.005, 0.001, 10)[0] == pytest.approx(0.0016)

    # noise the minimum cannot remove: below zero is stored as 0, and said so
    quiet_base = dict(stage2, base_fwd_bwd_samples_s=[0.44, 0.43, 0.45, 0.46, 0.44])
    value, why = hook_overhead(quiet_base, base, 0.0, 0.0, 10)
    assert value == 0.0 and why["raw_s_per_tensor"] == pytest.approx(-0.001) and "stored 0" in why["clamped"]

    # a profile from before the interleaving: each side's fastest step
    assert hook_overhead({"fwd_bwd_s": 0.44, "fwd_bwd_min_s": 0.42}, {"fwd_bwd_s": 0.515, "fwd_bwd_min_s": 0.40},
                         0.0, 0.0, 10)[0] == pytest.approx(0.002)
