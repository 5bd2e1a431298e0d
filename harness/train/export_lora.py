"""LoRA checkpoints -> a peft adapter folder (--adapter-only) or a merged Hugging Face model folder.

A LoRA checkpoint holds the trainable tensors only (exclude_frozen_parameters): under ZeRO-1/2/3 the fp32
partitions of the adapters (zero_to_fp32 reassembles just those, so nothing of the frozen base is gathered),
a pipeline's per-layer files, a tensor-parallel rank's split adapters (merged by tensor.merge_shards, which knows
that a column-parallel B and a row-parallel A are the split halves). The frozen base is the run's train.model,
rebuilt from the manifest (a preset from its seed, a folder or hub id from its weights).

    adapter folder:  adapter_config.json (peft.LoraConfig) + adapter_model.safetensors, keys
                     base_model.model.<module>.lora_A.weight: what PeftModel.from_pretrained(base, DIR) loads
    merged folder:   every base tensor, where an adapter sits W + scale * B @ A (transposed for GPT-2's Conv1D),
                     a per-tensor transform (merge_tensor) over the base's (name, tensor) stream
Both are checked against the probe logits the engine saved with the checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch

from harness.errors import UsageError
from harness.train import adapters

BASE_LAYER = ".base_layer"


def adapter_state(ref, manifest: dict) -> dict[str, torch.Tensor]:
    """The checkpoint's trainable tensors under their training names (<module>.lora_A.default.weight, ...)."""
    from harness.train.export import fp32_state_dict

    state = {k: v for k, v in fp32_state_dict(ref, manifest).items() if adapters.is_trainable_name(k)}
    empty = [k for k, v in state.items() if v.numel() == 0]
    if empty or not state:  # a ZeRO-3 partition saved without gathering (peft#2500) must never be written
        raise RuntimeError(f"{ref.tag_dir}: adapter tensors missing or empty ({empty[:3] or 'none found'})")
    return state


def _lora_modules(state: dict) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module name -> (A, B)."""
    out = {}
    for key, a in state.items():
        if key.endswith(f".lora_A.{adapters.ADAPTER}.weight"):
            name = key[: -len(f".lora_A.{adapters.ADAPTER}.weight")]
            out[name] = (a, state[f"{name}.lora_B.{adapters.ADAPTER}.weight"])
    return out


def merge_tensor(hf_name: str, tensor: torch.Tensor, lora: dict, scale: float, fan_in_fan_out: bool) -> torch.Tensor:
    """One base tensor of the merged model: W + scale * B @ A where a LoRA sits on its module, else unchanged."""
    module = hf_name.rsplit(".", 1)[0]
    if not hf_name.endswith(".weight") or module not in lora:
        return tensor
    a, b = lora[module]
    delta = (b.float() @ a.float()) * scale
    return (tensor.float() + (delta.T if fan_in_fan_out else delta)).to(tensor.dtype)


def base_model(manifest: dict):
    """The frozen base the run trained on, as the run built it (fp32)."""
    from harness.train.models import build_model

    return build_model(manifest["model"], seed=int(manifest.get("seed", 0))).float().eval()


def merged_state(base_state: dict, state: dict, adapter: dict, model_type: str) -> dict:
    """The merged model's state dict: the base streamed through merge_tensor, modules_to_save replaced."""
    lora, scale = _lora_modules(state), adapters.scaling(adapter)
    saved = {k.replace(f".modules_to_save.{adapters.ADAPTER}", ""): v for k, v in state.items()
             if ".modules_to_save." in k}
    return {name: saved.get(name, merge_tensor(name, t, lora, scale, model_type == "gpt2"))
            for name, t in base_state.items()}


def _check(ref, manifest: dict, model, what: str) -> float | None:
    from harness.train.export import TOLERANCE, verify

    diff = verify(ref, model)
    limit = TOLERANCE.get(manifest.get("precision", "fp32"), 1e-4)
    if diff is not None and diff > limit:
        raise RuntimeError(f"exported {what} disagrees with the engine: max |logit diff| {diff:.3g} > {limit}")
    return diff


def export_adapter(ref, manifest: dict, out: Path) -> dict:
    """adapter_config.json + adapter_model.safetensors, verified by loading them with plain peft."""
    from peft import PeftModel
    from safetensors.torch import save_file

    adapter, state = manifest["adapter"], adapter_state(ref, manifest)
    base = base_model(manifest)
    config = adapters.lora_config(adapter, base.config.model_type, base=manifest["model"])
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    save_file({adapters.peft_key(k): v.contiguous() for k, v in state.items()}, out / "adapter_model.safetensors",
              metadata={"format": "pt"})
    model = PeftModel.from_pretrained(base, out).eval()
    return {"max_logit_diff": _check(ref, manifest, model, "adapter"), "tensors": len(state),
            "adapter_params": sum(v.numel() for v in state.values())}


def export_merged(ref, manifest: dict, out: Path) -> dict:
    """The merged HF folder (base + scale * B @ A), verified against the engine's logits."""
    base = base_model(manifest)
    model_type = base.config.model_type
    merged = merged_state(base.state_dict(), adapter_state(ref, manifest), manifest["adapter"], model_type)
    base.load_state_dict(merged)
    diff = _check(ref, manifest, base, "merged model")
    out.mkdir(parents=True, exist_ok=True)
    base.save_pretrained(out, safe_serialization=True)
    return {"max_logit_diff": diff}


def export(ref, manifest: dict, out: Path, adapter_only: bool) -> dict:
    from transformers import AutoTokenizer

    if manifest.get("adapter", {}).get("type") != "lora":
        raise UsageError(f"{ref.tag_dir}: --adapter-only needs a LoRA run (adapter.type lora); this checkpoint "
                         "trained every weight\n    fix: export without --adapter-only")
    info = export_adapter(ref, manifest, out) if adapter_only else export_merged(ref, manifest, out)
    AutoTokenizer.from_pretrained(ref.ckpt_dir / "hf").save_pretrained(out)
    return info
