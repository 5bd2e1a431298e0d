"""Step 1 of a build by share: the whole HF model on the meta device, and what callers keep of it (ModelInfo)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from harness.config.defaults import PRECISION_DTYPES
from harness.config.moe_families import attn_implementation
from harness.model.hf import ATTN_IMPLEMENTATION, _zero3_context


def train_dtype(precision: str) -> torch.dtype:
    """The dtype the engine's weights have: fp32 runs fp32 weights; bf16/fp16 runs 16-bit weights, to which
    DeepSpeed adds its own fp32 master copy."""
    return getattr(torch, PRECISION_DTYPES[precision])


def dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class ModelInfo:
    """What the job needs of the HF model once the engine exists: its config (saved beside checkpoints), its
    whole-model parameter count (announced), the checkpoint's dtype and the dtype it trains in, and a pipeline's
    partition of the model's layers over its stages (checkpoint manifests)."""

    config: object
    num_params: int
    checkpoint_dtype: str | None
    train_dtype: str
    partition: dict = field(default_factory=dict)  # pipeline stages only (pipe_engine.build_stage)


def build_on_meta(config):
    """AutoModelForCausalLM for `config` with every parameter on meta (accelerate's init_empty_weights).

    Buffers are left real (include_buffers=False): they are tiny and computed from the config at construction
    (rotary inv_freq), so no buffer has to be recomputed after materialising and none is left on meta."""
    from accelerate import init_empty_weights

    from harness.model.hf import auto_class

    # never under zero.Init: an earlier ZeRO-3 build in this process (a driver running several jobs) leaves
    # transformers' DeepSpeed config registered, and zero.Init cannot partition meta tensors
    with _zero3_context(None), init_empty_weights(include_buffers=False):
        model = auto_class(config).from_config(config, attn_implementation=attn_implementation(config,
                                                                                      ATTN_IMPLEMENTATION))
    # init_empty_weights re-registers every parameter as a new meta Parameter, so the tie made during
    # construction (lm_head.weight = embed.weight) is lost; tie again now, outside its patch
    model.tie_weights()
    return model


def num_params(model) -> int:
    """Distinct parameters of the whole model (a tied weight once); works on meta."""
    return sum(p.numel() for p in model.parameters())


def left_on_meta(module) -> list[str]:
    return [name for name, t in [*module.named_parameters(), *module.named_buffers()] if t.device.type == "meta"]
