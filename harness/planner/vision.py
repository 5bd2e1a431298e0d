"""Vision-language models in the planner (pure): which parameters are the vision tower's, the projector's and the
language model's (by name prefix, per family), their counts on the meta device, and the image tokens a sample adds.

The prefix table is the one fact harness/model/vision.py also reads (model.freeze, the start-up line), so the
planner's counts and the live model's are the same split by construction; tests/test_vision_language.py checks them
against the live model."""

from __future__ import annotations

from dataclasses import dataclass

PARTS = ("vision", "projector", "language")  # vision.freeze's values


def is_vision_config(cfg: dict) -> bool:
    return bool(cfg.get("vision_config"))


@dataclass(frozen=True)
class Family:
    """Where a family keeps its parts (parameter-name prefixes) and how its vision tower is fed."""

    name: str
    vision: tuple[str, ...]  # the vision tower's prefixes (the projector's excluded)
    projector: tuple[str, ...]
    grid: bool  # Qwen-VL: patches [n, dim] + image_grid_thw per image, 3-D rotary positions

    def part_of(self, name: str) -> str:
        if name.startswith(self.projector):
            return "projector"
        if name.startswith(self.vision):
            return "vision"
        return "language"


QWEN = Family("qwen-vl", ("model.visual.",), ("model.visual.merger.",), grid=True)
LLAVA = Family("llava", ("model.vision_tower.",), ("model.multi_modal_projector.",), grid=False)


def family_of(model_type: str) -> Family:
    """Qwen-VL's layout (a `visual` tower with its merger) or LLaVA's (vision_tower + multi_modal_projector, which
    LLaVA-Next, Gemma 3, Mistral 3 and most others share)."""
    return QWEN if "qwen" in (model_type or "") else LLAVA


def parts_count(named_params, model_type: str) -> dict[str, int]:
    """{part: parameters} over (name, tensor) pairs (meta tensors and ZeRO-3's ds_numel both counted once)."""
    family, out, seen = family_of(model_type), dict.fromkeys(PARTS, 0), set()
    for name, param in named_params:
        if id(param) not in seen:
            seen.add(id(param))
            out[family.part_of(name)] += getattr(param, "ds_numel", param.numel())
    return out


def meta_parts(cfg: dict) -> dict[str, int]:
    """The parts' parameter counts of the model transformers builds from this config (meta device)."""
    import torch
    import transformers

    fields = dict(cfg)
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        model = transformers.AutoModelForImageTextToText.from_config(config)
    return parts_count(model.named_parameters(), cfg["model_type"])


def image_tokens(cfg: dict, height: int, width: int) -> int:
    """Image tokens one height x width image becomes (Qwen-VL: merged 14-px patches of the image as the processor
    resizes it to multiples of patch x merge; LLaVA-style: the tower's fixed grid, whatever the input size)."""
    vision = cfg["vision_config"]
    patch = vision.get("patch_size", 14)
    if family_of(cfg.get("model_type")).grid:
        merge = vision.get("spatial_merge_size", 2)
        unit = patch * merge
        return max(1, round(height / unit)) * max(1, round(width / unit))
    side = vision.get("image_size", 336) // patch
    return side * side + (1 if cfg.get("vision_feature_select_strategy") == "full" else 0)
