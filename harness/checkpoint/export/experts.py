"""LoRA on fused MoE experts (adapter.target_parameters) in the merged export: W[e] + scale * B_e @ A_e per expert.

transformers 5 keeps a layer's routed experts in 3-D tensors (mlp.experts.gate_up_proj [E, 2I, H], down_proj
[E, H, I]); peft's ParamWrapper adapts one such parameter with A [r*E, in] and B [out, r*E], and nests when two
parameters of one module are targeted (mlp.experts.base_layer wraps gate_up_proj, mlp.experts wraps down_proj,
in peft's order). Which wrapper adapts which tensor is read off the adapters peft injects into the model built on
the meta device, so the names never have to be guessed. The update is peft's get_delta_weight:
    A -> [E, r, in], B -> [out, r, E];  delta[e] = scale * B[:, :, e] @ A[e]   ([E, out, in]; transposed when the
    model stores [E, in, out], as gpt-oss does, where peft's wrapper did not swap in and out).
"""

from __future__ import annotations

import torch

from harness.model import adapters

BASE_LAYER = ".base_layer"


def wrapped(adapter: dict, model) -> dict[str, tuple[str, bool]]:
    """{training module name of each ParamWrapper: (HF name of the tensor it adapts, stored [E, out, in])}, from
    peft's own injection into a meta copy of `model` (nothing allocated). Empty without target_parameters."""
    if not adapter.get("target_parameters"):
        return {}
    from peft import inject_adapter_in_model
    from peft.tuners.lora.layer import ParamWrapper
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(model.config)
        inject_adapter_in_model(adapters.lora_config(adapter, model.config.model_type), meta,
                                adapter_name=adapters.ADAPTER)
    return {name: (f"{name.replace(BASE_LAYER, '')}.{module.parameter_name}", module._did_swap_in_out_features)
            for name, module in meta.named_modules() if isinstance(module, ParamWrapper)}


def delta(a: torch.Tensor, b: torch.Tensor, experts: int, scale: float, out_in: bool) -> torch.Tensor:
    """peft's ParamWrapper.get_delta_weight for one adapter, in fp32."""
    a = a.float().reshape(experts, -1, a.shape[-1])  # [E, r, in]
    b = b.float().reshape(b.shape[0], -1, experts)  # [out, r, E]
    return torch.einsum("ore,eri->eoi" if out_in else "ore,eri->eio", b, a) * scale


def merge(tensor: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, out_in: bool) -> torch.Tensor:
    """One fused expert tensor of the merged model: W + the adapter's update, in W's dtype."""
    return (tensor.float() + delta(a, b, tensor.shape[0], scale, out_in)).to(tensor.dtype)


def split_off(lora: dict, adapter: dict, model) -> dict[str, tuple]:
    """Take the expert wrappers out of `lora` ({module: (A, B, magnitude)}, lora.py's plain 2-D merge) and return
    {HF tensor name: (A, B, out_in)} for `merge`."""
    out = {}
    for module, (hf_name, out_in) in wrapped(adapter, model).items():
        if module in lora:
            a, b, _ = lora.pop(module)
            out[hf_name] = (a, b, out_in)
    return out
