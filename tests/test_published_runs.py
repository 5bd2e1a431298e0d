"""The step-time model against published training runs: Megatron-LM on NVIDIA Selene (DGX A100 80GB).

One named profile (harness/planner/profiles/a100-80gb-sxm.json) with its one efficiency constant
(gemm_efficiency), the same for every row: nothing here is fitted per row. Each predicted iteration time must
lie within +-15 % of the published one.

Where the figures come from (docs/published-runs.md has the full setups):
- A1-A10: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM", arXiv 2104.04473, Table 1 (weak scaling), as published in NVIDIA/Megatron-LM
  images/cases_april2021.png (commit 50a4b5fa02, 2021-04-08). The table gives achieved teraFLOP/s per GPU in
  the hardware-FLOPs convention (full recomputation counted: 96 B s l h^2 (1 + s/6h + V/16lh), paper s5.1);
  the iteration time is derived from it: t = F_hw / (GPUs x TFLOP/s). s = 2048, V = 51,200, fp16. The TP/PP
  split follows the paper's rule (TP = min(MP, 8), PP = MP / 8); micro-batch 1 (not stated: assumed).
- C1-C4: Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", arXiv 2205.05198,
  Table 5, the full-recompute column (iteration seconds), with the layouts of calculon-ai/calculon
  validation/seqsel/tab5/*_full.json (TP 8, DP 1, micro-batch 1, or 4 for 22B, pipeline interleaving 3 for
  175B and 530B, 1 otherwise).

How the model treats what DeepSpeed and the harness lack:
- Megatron's interleaved 1F1B schedule (v model chunks per stage) is not something DeepSpeed can run. The
  model has one parameter for it, `interleave`, used only here: it divides the bubble's (p - 1) slots by v
  (2104.04473 s2.2.2) and leaves everything else as for DeepSpeed's TrainSchedule. Table 5 rows use the v of
  Calculon's files; Table 1 does not say whether it interleaved, so those rows are predicted with DeepSpeed's
  own schedule (v = 1), the pessimistic reading.
- Sequence parallelism: the full-recompute column of Table 5 is the paper's baseline, tensor parallel
  without sequence parallelism, which is what the model times (two all-reduces per block in forward, two in
  backward, two in the recomputed forward). The SP + selective column is not tested: the harness has no
  sequence parallelism.
- Megatron 2021-22 materialises the s x s attention scores (fused softmax, no flash attention): these rows set
  attention "materialized", adding the 5 a s bytes per token of 2205.05198 eq. 1 to the memory-bound work.
  Megatron also splits the blocks evenly over the stages (l / p each), which stage_blocks passes; the
  harness's own pipelines use DeepSpeed's partition.
- Megatron 2021 all-reduces data-parallel gradients after backward without overlap: layout ZeRO-0, whose
  reduction the model never overlaps.
"""

from __future__ import annotations

import pytest

from harness.planner import hardware, layouts, steptime
from harness.planner.inputs import Workload
from harness.planner.params import count_params, model_shape

SEQ, VOCAB = 2048, 51_200
PROFILE = "a100-80gb-sxm"
TOLERANCE = 0.15

# id: layers, hidden, heads, GPUs, TP, PP, DP, global batch, published TFLOP/s per GPU (hw convention)
TABLE1 = {
    "A1": (24, 2304, 24, 32, 1, 1, 32, 512, 137), "A2": (30, 3072, 32, 64, 2, 1, 32, 512, 138),
    "A3": (36, 4096, 32, 128, 4, 1, 32, 512, 142), "A4": (40, 6144, 48, 256, 8, 1, 32, 1024, 135),
    "A5": (48, 8192, 64, 512, 8, 2, 32, 1536, 138), "A6": (60, 10240, 80, 1024, 8, 4, 32, 1792, 140),
    "A7": (80, 12288, 96, 1536, 8, 8, 24, 2304, 148), "A8": (96, 16384, 128, 1920, 8, 16, 15, 2160, 155),
    "A9": (105, 20480, 128, 2520, 8, 35, 9, 2520, 163), "A10": (128, 25600, 160, 3072, 8, 64, 6, 3072, 163),
}
# id: layers, hidden, heads, GPUs, TP, PP, DP, global batch, micro-batch, published iteration s, interleave
TABLE5 = {
    "C1": (48, 6144, 64, 8, 8, 1, 1, 4, 4, 1.42, 1), "C2": (96, 12288, 96, 64, 8, 8, 1, 64, 1, 18.13, 3),
    "C3": (105, 20480, 128, 280, 8, 35, 1, 280, 1, 49.05, 3), "C4": (128, 25600, 160, 512, 8, 64, 1, 512, 1, 94.42, 1),
}


def hw_flops(batch: int, layers: int, hidden: int) -> float:
    """2104.04473 s5.1: FLOPs per iteration with full recomputation."""
    return 96 * batch * SEQ * layers * hidden**2 * (1 + SEQ / (6 * hidden) + VOCAB / (16 * layers * hidden))


def predict(layers, hidden, heads, gpus, tp, pp, dp, batch, micro, interleave) -> dict:
    cfg = {"model_type": "gpt2", "n_embd": hidden, "n_layer": layers, "n_head": heads, "n_positions": SEQ,
           "vocab_size": VOCAB}  # Megatron's GPT: learned positions, 4h MLP, tied embedding
    count, shape = count_params(cfg), model_shape(cfg)
    hw = layouts.hardware(8, gpus // 8, 80 * 10**9, None, None)
    work = Workload(**{"seq_len": SEQ, "micro_batch": micro, "grad_accum": batch // (dp * micro), "precision": "fp16",
            "activation_checkpointing": True, "global_batch": batch, "attention": "materialized"})
    c = layouts.Candidate("3d" if pp > 1 else "tp", 0, tp=tp, pp=pp)
    assert tp * pp * dp == gpus == hw.world
    result = layouts.evaluate(c, count, shape, hw, work)
    megatron = steptime.Megatron(interleave, (layers // pp,) * pp if pp > 1 else None)
    return steptime.step_time(c, count, shape, hardware.load(PROFILE), hw, work, result, megatron)


@pytest.mark.parametrize("row", sorted(TABLE1, key=lambda k: int(k[1:])))
def test_megatron_table1_weak_scaling(row):
    layers, hidden, heads, gpus, tp, pp, dp, batch, tflops = TABLE1[row]
    published_s = hw_flops(batch, layers, hidden) / (gpus * tflops * 1e12)
    got = predict(layers, hidden, heads, gpus, tp, pp, dp, batch, 1, 1)
    error = got["step_time_s"] / published_s - 1
    assert abs(error) <= TOLERANCE, f"{row}: predicted {got['step_time_s']:.2f} s vs published {published_s:.2f} s " \
                                    f"({error:+.1%}); breakdown {got['breakdown']}"


@pytest.mark.parametrize("row", sorted(TABLE5))
def test_korthikanti_table5_full_recompute(row):
    layers, hidden, heads, gpus, tp, pp, dp, batch, micro, published_s, interleave = TABLE5[row]
    got = predict(layers, hidden, heads, gpus, tp, pp, dp, batch, micro, interleave)
    error = got["step_time_s"] / published_s - 1
    assert abs(error) <= TOLERANCE, f"{row}: predicted {got['step_time_s']:.2f} s vs published {published_s:.2f} s " \
                                    f"({error:+.1%}); breakdown {got['breakdown']}"


def test_one_named_profile_one_constant():
    profile = hardware.load(PROFILE)
    assert profile["peak_tflops"]["fp16"] == 312.0 and 0 < profile["gemm_efficiency"] < 1
    assert "Megatron" in profile["source"]  # the file says how its constant was chosen


def test_the_interleaved_schedule_only_shrinks_the_bubble():
    one = predict(96, 12288, 96, 64, 8, 8, 1, 64, 1, 1)
    three = predict(96, 12288, 96, 64, 8, 8, 1, 64, 1, 3)
    assert three["breakdown"]["bubble_s"] == pytest.approx(one["breakdown"]["bubble_s"] / 3)
    assert {k: v for k, v in three["breakdown"].items() if k != "bubble_s"} == \
           {k: v for k, v in one["breakdown"].items() if k != "bubble_s"}
