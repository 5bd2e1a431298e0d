"""FP8 matmuls (train.fp8): torchao's float8 training (`torchao.float8.convert_to_float8_training`) swaps the
model's nn.Linear layers for Float8Linear before deepspeed.initialize: each matmul casts its input, weight and
gradient to float8 with a tensorwise scale and runs on FP8 tensor cores (torch._scaled_mm), while the weights,
gradients, master copy and optimizer states keep their dtypes (the planner's bytes are unchanged). docs/optimizers.md.

problems(spec): what refuses it before any rank trains (no CUDA device, tensor cores below sm89, no torchao, and
the layouts the harness has not run it on). The swap itself runs on the CPU too (emulated, slower than bf16): that is
how tests/test_lowbit.py checks it against bf16 on live ZeRO-2 engines. convert(module, recipe): the swap, on the
built HF model.
"""

from __future__ import annotations

from harness.config.adapter_rules import lora_on
from harness.errors import Problem

MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (sm89), Hopper (sm90), Blackwell
FIX_OFF = "set train.fp8=false (bf16 matmuls)"


def problems(spec) -> list[Problem]:
    """The device and layout checks for train.fp8 (none without it)."""
    import importlib.util

    import torch

    recipe = spec.recipe
    if not recipe["train"].get("fp8"):
        return []
    out = []
    if not torch.cuda.is_available():
        out.append(Problem("train.fp8", "FP8 matmuls pay off on CUDA tensor cores of compute capability 8.9 or "
                           "newer (Ada, Hopper, Blackwell); this machine has no CUDA device (torch "
                           f"{torch.__version__}), and on the CPU torch._scaled_mm is emulated: measured 3.9x "
                           "slower than bf16 (two 1024 x 1024 Linear layers, 512 rows, forward and backward)",
                           f"{FIX_OFF}, or run on an H100, H200, L40S or newer"))
    elif torch.cuda.get_device_capability() < MIN_CAPABILITY:
        major, minor = torch.cuda.get_device_capability()
        out.append(Problem("train.fp8", f"FP8 matmuls need compute capability 8.9 or newer; "
                           f"{torch.cuda.get_device_name()} is {major}.{minor}",
                           f"{FIX_OFF}, or run on an H100 or newer"))
    if importlib.util.find_spec("torchao") is None:
        out.append(Problem("train.fp8", "FP8 matmuls come from torchao's float8 training, which is not installed",
                           "pip install -e '.[lowbit]' (torchao 0.18)"))
    if recipe["precision"] != "bf16":
        out.append(Problem("train.fp8", f"FP8 matmuls with precision {recipe['precision']!r}: torchao's float8 "
                           "training keeps bf16 as the high precision around each FP8 matmul", "set precision bf16"))
    layout = [name for name, on in (("ZeRO-3", recipe["zero"]["stage"] == 3), ("pipeline", spec.pp > 1),
                                    ("tensor parallel", spec.tp > 1), ("LoRA", lora_on(recipe)))
              if on]
    if layout:
        out.append(Problem("train.fp8", f"FP8 matmuls with {', '.join(layout)}: the harness swaps whole-model "
                           "nn.Linear layers before deepspeed.initialize and has run that on ZeRO 0-2 data "
                           "parallel only (ZeRO-3's partitioned weights, split or staged layers and LoRA's wrapped "
                           "Linears are untried)", f"use zero.stage 1 or 2 without pipeline, tensor parallel or "
                           f"LoRA, or {FIX_OFF}"))
    return out


def takes(module, fqn: str) -> bool:
    """Which Linear layers go FP8: every one whose both dimensions are multiples of 16 (torch._scaled_mm's rule),
    except the output head (its logits feed the loss; torchtitan keeps it in bf16 too)."""
    import torch

    return (isinstance(module, torch.nn.Linear) and not fqn.endswith("lm_head")
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)


def convert(module, recipe: dict) -> str | None:
    """Swap `module`'s Linear layers for torchao's Float8Linear per train.fp8; the start-up line, or None."""
    if not recipe["train"].get("fp8"):
        return None
    import torch
    from torchao.float8 import convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    linears = sum(isinstance(m, torch.nn.Linear) for m in module.modules())
    convert_to_float8_training(module, module_filter_fn=takes)
    swapped = sum(isinstance(m, Float8Linear) for m in module.modules())
    return (f"fp8: {swapped} of {linears} Linear layers run their matmuls in float8 (torchao, tensorwise scales); "
            "the output head and layers with a dimension not a multiple of 16 stay bf16")
