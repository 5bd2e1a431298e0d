"""LoRA checkpoints -> a peft adapter folder (--adapter-only) or a merged Hugging Face model folder.

A LoRA checkpoint holds the trainable tensors only (exclude_frozen_parameters): under ZeRO-1/2/3 the fp32
partitions of the adapters (so nothing of the frozen base is ever gathered), a pipeline's per-layer files, a
tensor-parallel rank's split adapters (tensor.merge_tensor knows a column-parallel B and a row-parallel A are the
split halves); export.open_state reads them all. The frozen base is the run's train.model (the manifest's model
and seed: a folder's safetensors, or a preset's seeded weights).

    adapter folder:  adapter_config.json (peft.LoraConfig) + adapter_model.safetensors, keys
                     base_model.model.<module>.lora_A.weight: what PeftModel.from_pretrained(base, DIR) loads
    merged folder:   export.py's sharded stream, each base tensor read when written and passed through
                     merge_tensor: W + scale * B @ A where an adapter sits (transposed for GPT-2's Conv1D)
Both are checked against the probe logits the engine saved with the checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch

from harness.errors import UsageError
from harness.model import adapters

BASE_LAYER = ".base_layer"


def adapter_state(ref, manifest: dict) -> dict[str, torch.Tensor]:
    """The checkpoint's trainable tensors under their training names (<module>.lora_A.default.weight, ...), read
    through export's own per-layout sources (ZeRO partitions, pipeline layer files, TP ranks merged)."""
    from harness.checkpoint.export.ckpt_tensors import MappedFiles
    from harness.checkpoint.export.state import open_state

    state = {k: v.read().float() for k, v in open_state(ref, manifest, MappedFiles()).items()
             if adapters.is_trainable_name(k)}
    empty = [k for k, v in state.items() if v.numel() == 0]
    if empty or not state:  # a ZeRO-3 partition saved without gathering (peft#2500) must never be written
        raise RuntimeError(f"{ref.tag_dir}: adapter tensors missing or empty ({empty[:3] or 'none found'})")
    return state


def _lora_modules(state: dict) -> dict[str, tuple]:
    """module name -> (A, B, DoRA magnitude or None)."""
    out = {}
    for key, a in state.items():
        if key.endswith(f".lora_A.{adapters.ADAPTER}.weight"):
            name = key[: -len(f".lora_A.{adapters.ADAPTER}.weight")]
            out[name] = (a, state[f"{name}.lora_B.{adapters.ADAPTER}.weight"],
                         state.get(f"{name}.lora_magnitude_vector.{adapters.ADAPTER}.weight"))
    return out


def merge_tensor(hf_name: str, tensor: torch.Tensor, lora: dict, scale: float, fan_in_fan_out: bool) -> torch.Tensor:
    """One base tensor of the merged model: W + scale * B @ A where a LoRA sits on its module, else unchanged.
    DoRA (a magnitude m per output feature): m * (W + s B A) / ||W + s B A|| row-wise, as peft merges it."""
    module = hf_name.rsplit(".", 1)[0]
    if not hf_name.endswith(".weight") or module not in lora:
        return tensor
    a, b, magnitude = lora[module]
    delta = (b.float() @ a.float()) * scale  # (out, in)
    weight = (tensor.float().T if fan_in_fan_out else tensor.float()) + delta
    if magnitude is not None:
        weight = weight * (magnitude.float() / weight.norm(p=2, dim=1)).unsqueeze(1)
    return (weight.T if fan_in_fan_out else weight).contiguous().to(tensor.dtype)


def base_model(manifest: dict, ref):
    """The frozen base the run trained on, as the run built it (fp32): what the adapter folder is checked on. A
    reward model's (its hf/config.json names a *ForSequenceClassification) with its seeded score head."""
    from transformers import AutoConfig

    from harness.model.hf import build_model

    architectures = AutoConfig.from_pretrained(ref.ckpt_dir / "hf").architectures or []
    head = "reward" if any(a.endswith("ForSequenceClassification") for a in architectures) else "causal"
    return build_model(manifest["model"], seed=int(manifest.get("seed", 0)), head=head).float().eval()


def merged_lazy(manifest: dict, state: dict, model) -> dict:
    """export's {hf name: Lazy} for the merged model: each base tensor read from train.model when the writer asks
    for it (a folder's safetensors, or a preset's seeded weights) and passed through merge_tensor; the adapters
    (small) are read once. `model`: the meta model, for names and shapes."""
    from harness.checkpoint.export.ckpt_tensors import Lazy
    from harness.model.load.base import open_source
    from harness.model.load.renamed import renamed_view
    from harness.model.load.slices import Request

    trained = {k: v.read().float() for k, v in state.items() if adapters.is_trainable_name(k)}
    from harness.checkpoint.export import experts

    lora, scale = _lora_modules(trained), adapters.scaling(manifest["adapter"])
    on_experts = experts.split_off(lora, manifest["adapter"], model)  # LoRA on fused 3-D expert tensors
    saved = {k.replace(f".modules_to_save.{adapters.ADAPTER}", ""): v for k, v in trained.items()
             if ".modules_to_save." in k}
    if saved and getattr(model.config, "tie_word_embeddings", False) and not adapters.head_modules(model):
        raise UsageError(f"modules_to_save {sorted(saved)} on a model with tied embeddings: the merged folder would "
                         "tie the trained copy back to the frozen embedding\n    fix: export with --adapter-only")
    source = renamed_view(open_source(manifest["model"], int(manifest.get("seed", 0))), model)  # VL folders' keys
    fan_in_fan_out = model.config.model_type == "gpt2"  # Conv1D stores W transposed

    def read(name: str) -> torch.Tensor:
        if name in saved:
            return saved[name]
        base = source.read({name: Request()}, torch.float32)[name]
        if name in on_experts:
            return experts.merge(base, *on_experts[name][:2], scale, on_experts[name][2])
        return merge_tensor(name, base, lora, scale, fan_in_fan_out)

    keys = source.keys()
    return {name: Lazy(tuple(t.shape), lambda n=name: read(n)) for name, t in model.state_dict().items()
            if name in keys or name in saved}


def _check(ref, manifest: dict, model, what: str) -> float | None:
    """Max |logit difference| of `model` vs the engine's probe logits; refuses beyond the training dtype's bound."""
    from harness.checkpoint.export.state import PROBE, TOLERANCE, train_dtype

    probe = ref.tag_dir / PROBE
    if not probe.is_file():
        return None
    saved = torch.load(probe, map_location="cpu", weights_only=True)
    with torch.no_grad():
        diff = float((model(input_ids=saved["input_ids"]).logits.float() - saved["logits"].float()).abs().max())
    limit = TOLERANCE[train_dtype(manifest)]
    if diff > limit:
        raise UsageError(f"{ref.tag_dir}: the exported {what} disagrees with the engine: max |logit diff| {diff:.3g} "
                         f"> {limit}\n    fix: check that train.model still holds the base this run trained on")
    return diff


def export_adapter(ref, manifest: dict, out: Path, dtype: torch.dtype) -> dict:
    """adapter_config.json + adapter_model.safetensors (+ tokenizer), verified by loading them with plain peft."""
    from peft import PeftModel
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    if manifest.get("adapter", {}).get("type") != "lora":
        raise UsageError(f"{ref.tag_dir}: --adapter-only needs a LoRA run (adapter.type lora); this checkpoint "
                         "trained every weight\n    fix: export without --adapter-only")
    adapter, state = manifest["adapter"], adapter_state(ref, manifest)
    base = base_model(manifest, ref)
    from harness.planner.vision import lora_exclude

    vision = lora_exclude(base.config) is not None  # a vision-language model: the modules the run adapted, by name
    config = adapters.lora_config(adapter, base.config.model_type, base=manifest["model"],
                                  exclude=lora_exclude(base.config), targets=sorted(_lora_modules(state)) if vision
                                  else None, head=adapters.head_modules(base))
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    tensors = {adapters.peft_key(k): v.to(dtype).contiguous() for k, v in state.items()}
    save_file(tensors, out / "adapter_model.safetensors", metadata={"format": "pt"})
    AutoTokenizer.from_pretrained(ref.ckpt_dir / "hf").save_pretrained(out)
    _copy_image_processor(ref, out)
    model = PeftModel.from_pretrained(base, out).eval()
    return {"max_logit_diff": _check(ref, manifest, model, "adapter"), "tensors": len(state), "shards": 1,
            "adapter_params": sum(v.numel() for v in state.values()),
            "total_size_bytes": sum(v.numel() * v.element_size() for v in tensors.values())}


def _copy_image_processor(ref, out: Path) -> None:
    """A vision-language run's image processor beside the adapter (as beside a merged export)."""
    import shutil

    from harness.checkpoint.export.state import IMAGE_PROCESSOR

    if (ref.ckpt_dir / "hf" / IMAGE_PROCESSOR).is_file():
        shutil.copy(ref.ckpt_dir / "hf" / IMAGE_PROCESSOR, out / IMAGE_PROCESSOR)
