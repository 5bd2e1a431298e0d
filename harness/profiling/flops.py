"""Model FLOPs per token and the peak FLOP/s of known accelerators, for MFU.

Training FLOPs per token = 6 N + 12 L d_attn S (PaLM, appendix B; nanoGPT's estimate_mfu):
  6 N           forward (2N) and backward (4N) matmuls over the N parameters a token multiplies with: all
                parameters except embedding lookup tables (a tied input embedding counts once, as the head)
  12 L d_attn S the attention score and value matmuls (QK^T and AV: 2 x 2 S d_attn per layer forward, x3
                for training), counted over the full sequence as PaLM does (no causal halving)
Activation recomputation is not counted (that would be hardware FLOPs, HFU, not model FLOPs).
Pure: no torch.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from harness.planner.shape import ModelShape

PEAK_ENV = "HARNESS_PEAK_TFLOPS"  # override for a device not in the table: dense TFLOP/s per device

# Dense (no sparsity) TFLOP/s per device from the vendors' datasheets; fp32 = plain fp32 (no TF32),
# which is what torch uses for fp32 matmuls by default. Matched by substring of the device name, in order.
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    ("GH200", {"bf16": 989.4, "fp16": 989.4, "fp32": 67.0}),
    ("H200", {"bf16": 989.4, "fp16": 989.4, "fp32": 67.0}),
    ("H100 PCIe", {"bf16": 756.5, "fp16": 756.5, "fp32": 51.0}),
    ("H100", {"bf16": 989.4, "fp16": 989.4, "fp32": 67.0}),  # SXM ("NVIDIA H100 80GB HBM3")
    ("B200", {"bf16": 2250.0, "fp16": 2250.0, "fp32": 80.0}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}),
    ("L40S", {"bf16": 362.05, "fp16": 362.05, "fp32": 91.6}),
    ("L4", {"bf16": 121.0, "fp16": 121.0, "fp32": 30.3}),
    ("V100", {"fp16": 125.0, "fp32": 15.7}),
    ("MI300X", {"bf16": 1307.4, "fp16": 1307.4, "fp32": 163.4}),
]


def matmul_params(total: int, shape: ModelShape) -> int:
    """Parameters a token multiplies with: all but the lookup tables (learned positions; the token table
    unless it is tied to the head, which multiplies every token). `shape` is planner.params.model_shape."""
    token_table = shape.vocab_size * shape.hidden_size
    positions = shape.max_positions * shape.hidden_size if shape.learned_positions else 0
    return total - positions - (0 if shape.tie_word_embeddings else token_table)


def flops_per_token(total_params: int, shape: ModelShape, seq_len: int) -> int:
    """Training model FLOPs per token (forward + backward) for the whole model."""
    attn_dim = shape.num_attention_heads * shape.head_dim
    return 6 * matmul_params(total_params, shape) + 12 * shape.num_hidden_layers * attn_dim * seq_len


def peak_tflops(device_name: str, precision: str) -> tuple[float | None, str | None]:
    """(dense peak TFLOP/s per device, None) or (None, why MFU is not given)."""
    if os.environ.get(PEAK_ENV):
        return float(os.environ[PEAK_ENV]), None
    if not device_name or device_name.lower() == "cpu":
        return None, ("MFU is not meaningful on CPU: there is no fixed peak FLOP/s to divide by "
                      "(tflops_per_gpu is the achieved model FLOP/s per rank)")
    for key, peaks in PEAK_TFLOPS:
        if key.lower() in device_name.lower():
            if precision in peaks:
                return peaks[precision], None
            return None, f"{device_name} has no {precision} peak in the table"
    return None, (f"unknown device {device_name!r}: add its dense peak to PEAK_TFLOPS in "
                  f"harness/profiling/flops.py or set {PEAK_ENV}")


def mfu(tokens_per_s: float, flops_per_tok: int, num_devices: int, peak: float | None) -> float | None:
    if peak is None or not tokens_per_s or num_devices < 1:
        return None
    return tokens_per_s * flops_per_tok / num_devices / (peak * 1e12)
