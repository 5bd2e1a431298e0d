"""8-bit optimizer states and FP8 matmuls (issue #47 item 4, docs/optimizers.md), on live DeepSpeed engines.

tests/drivers/lowbit_engines.py's cases, in the 2-rank launch tests/test_optimizers.py shares (conftest's
optim_engines_2; ZeRO-2, bf16, the tiny Llama of test_optimizers.py):
- int8: why optimizer.state_dtype int8 is refused. torchao's AdamW8bit as DeepSpeed's client optimizer keeps fp32
  moments on ZeRO's flat partition unless 256 divides it; if a torchao or DeepSpeed upgrade makes this fail,
  revisit optimizer_rules.INT8_STATES_REASON.
- fp8: train.fp8's swap (harness/model/fp8.py) composes with the engine: the Linear layers but the head run in
  float8 (torch._scaled_mm, emulated on the CPU) and the losses and updates stay within a measured band of bf16.
On this CPU-only machine train.fp8 itself is refused before launch (tested below); bench/gpu_check.sh's fp8 case
measures tokens/s and peak memory against bf16 on a GPU.
"""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from helpers.launch import run_checked

# Measured (3 steps, AdamW lr 1e-3, 2 ranks): fp8 against bf16 losses 8e-5 .. 6.7e-4 relative; the updates of layer
# 0's projections and the head 0.16 .. 0.21 (the norm of the difference over the norm of the bf16 update: Adam's
# first steps are near lr * sign(gradient), so the float8 rounding flips the small entries)
LOSS_BAND, UPDATE_BAND = 1e-3, 0.25


@pytest.fixture(scope="module")
def engines(optim_engines_2):
    """Each rank's int8 and fp8 results: the `lowbit` part of the 2-rank launch shared with tests/test_optimizers.py
    (conftest's optim_engines_2; the cases are tests/drivers/lowbit_engines.py's)."""
    return [rank["lowbit"] for rank in optim_engines_2[1]]


@pytest.mark.multirank
def test_int8_states_stay_fp32_on_zero_partitions_unless_256_divides_them(engines):
    for res in engines:
        all_, frozen = res["all"]["partitions"], res["norms_frozen"]["partitions"]
        assert [p["numel"] for p in all_] == [69792] and [p["numel"] for p in frozen] == [69632], res
        for state in ("exp_avg", "exp_avg_sq"):  # 69,792 = 272.6 blocks: fp32, 4 B per element
            assert all_[0][state] == {"class": "Tensor", "bytes": 4 * 69792}, all_
            # 69,632 = 272 blocks: 1 B codes + a 4 B scale per 256 + the 256-entry fp32 code map
            assert frozen[0][state] == {"class": "OptimState8bit", "bytes": 69632 + 4 * 272 + 4 * 256}, frozen
        for run in (res["all"], res["norms_frozen"]):
            assert all(math.isfinite(x) for x in run["losses"]) and run["losses"][1] < run["losses"][0], run


@pytest.mark.multirank
def test_fp8_matmuls_train_within_a_band_of_bf16_on_zero2(engines):
    for res in engines:
        bf16, fp8 = res["bf16"], res["fp8"]
        assert bf16["swapped"] == [] and bf16["note"] is None
        assert len(fp8["swapped"]) == 14 and not any("lm_head" in n for n in fp8["swapped"]), fp8["swapped"]
        assert fp8["note"].startswith("fp8: 14 of 15 Linear layers")
        gaps = [abs(a - b) / b for a, b in zip(fp8["losses"], bf16["losses"])]
        assert 0 < max(gaps) <= LOSS_BAND, gaps  # 0: the float8 casts did nothing (the swap silently off)
        assert fp8["losses"][-1] < fp8["losses"][0], fp8["losses"]
    ref, got = engines[0]["bf16"]["update"], engines[0]["fp8"]["update"]
    swapped = [n for n in ref if n.removesuffix(".weight") in engines[0]["fp8"]["swapped"]]
    assert len(swapped) == 7, list(ref)  # layer 0's q, k, v, o, gate, up, down
    for name in swapped + ["lm_head.weight"]:  # the head is bf16 but its gradient comes through float8 layers
        a, b = torch.tensor(got[name]), torch.tensor(ref[name])
        gap = ((a - b).norm() / b.norm()).item()
        assert 0 < gap <= UPDATE_BAND, (name, gap)


def test_fp8_on_a_cpu_machine_is_refused_before_launch_with_the_reason():
    cmd = [sys.executable, "-m", "harness.cli", "launch", "--dry-run", "--num_gpus", "1", "harness/run.py",
           "--recipe", "zero3", "--set", "train.fp8=true"]
    proc = run_checked(cmd, 120, False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    if not torch.cuda.is_available():
        assert "torch._scaled_mm is emulated: measured 3.9x slower than bf16" in proc.stderr
    assert "FP8 matmuls with ZeRO-3" in proc.stderr and "use zero.stage 1 or 2" in proc.stderr
