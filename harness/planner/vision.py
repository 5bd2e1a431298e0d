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
    tower_modules: str  # a regex of the vision tower's module names (projector excluded): no LoRA there
    token_types: bool = False  # Gemma 3: token_type_ids mark the image tokens (bidirectional attention per image)

    def part_of(self, name: str) -> str:
        if name.startswith(self.projector):
            return "projector"
        if name.startswith(self.vision):
            return "vision"
        return "language"


QWEN = Family("qwen-vl", ("model.visual.",), ("model.visual.merger.", "model.visual.deepstack_merger_list."),
              grid=True, tower_modules=r"(.*\.)?visual\.(?!merger\.|deepstack_merger_list\.).*")  # Qwen3-VL's too
LLAVA = Family("llava", ("model.vision_tower.",), ("model.multi_modal_projector.",), grid=False,
               tower_modules=r"(.*\.)?vision_tower\..*")

GEMMA3 = Family("gemma3", LLAVA.vision, LLAVA.projector, grid=False, tower_modules=LLAVA.tower_modules,
                token_types=True)


def lora_exclude(config) -> str | None:
    """The modules LoRA leaves alone in a vision-language model: its vision tower (a CLIP tower's q_proj / v_proj
    match the default target suffixes); None for a text-only model. LoRA goes on the language model and, when
    adapter.target_modules names its layers (linear_1 / linear_2, mlp.0 / mlp.2), the projector."""
    if getattr(config, "vision_config", None) is None:
        return None
    return family_of(getattr(config, "model_type", "")).tower_modules


def family_of(model_type: str) -> Family:
    """Qwen-VL's layout (a `visual` tower with its merger) or LLaVA's (vision_tower + multi_modal_projector, which
    LLaVA-Next, Gemma 3, Mistral 3 and most others share; Gemma 3 also marks its image tokens' types)."""
    if model_type == "gemma3":
        return GEMMA3
    return QWEN if "qwen" in (model_type or "") else LLAVA


def parts_count(named_params, model_type: str) -> dict[str, int]:
    """{part: parameters} over (name, tensor) pairs (meta tensors and ZeRO-3's ds_numel both counted once)."""
    family, out, seen = family_of(model_type), dict.fromkeys(PARTS, 0), set()
    for name, param in named_params:
        if id(param) not in seen:
            seen.add(id(param))
            out[family.part_of(name)] += getattr(param, "ds_numel", param.numel())
    return out


def meta_model(cfg: dict):
    """The model transformers builds from this config, on the meta device (no memory)."""
    import torch
    import transformers

    from harness.planner.params import outside_zero3

    fields = dict(cfg)
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    with outside_zero3(), torch.device("meta"):
        return transformers.AutoModelForImageTextToText.from_config(config)


def meta_parts(cfg: dict) -> dict[str, int]:
    """The parts' parameter counts of the model transformers builds from this config (meta device)."""
    return parts_count(meta_model(cfg).named_parameters(), cfg["model_type"])


def image_tokens(cfg: dict, height: int, width: int) -> int:
    """Image tokens one height x width image becomes (Qwen-VL: merged 14-px patches of the image as the processor
    resizes it to multiples of patch x merge; LLaVA-style: the tower's fixed grid, whatever the input size)."""
    vision = cfg["vision_config"]
    patch = vision.get("patch_size", 14)
    if family_of(cfg.get("model_type")).grid:
        merge = vision.get("spatial_merge_size", 2)
        unit = patch * merge
        return max(1, round(height / unit)) * max(1, round(width / unit))
    if cfg.get("mm_tokens_per_image"):  # Gemma 3: the tower's patches pooled to a fixed count
        return cfg["mm_tokens_per_image"]
    side = vision.get("image_size", 336) // patch
    return side * side + (1 if cfg.get("vision_feature_select_strategy") == "full" else 0)


ACTIVATION_BYTES_PER_TOKEN_HIDDEN = 34  # a transformer layer's saved activations, 16-bit (Korthikanti et al., no
# attention scores: the flash / sdpa kernels keep none), per token and hidden unit


def vision_patches(cfg: dict, height: int, width: int) -> int:
    """Tokens the vision tower itself runs on for one image (before Qwen-VL's merger; LLaVA: patches + CLIP's CLS;
    Gemma 3: SigLIP's patches, no CLS)."""
    vision = cfg["vision_config"]
    if family_of(cfg.get("model_type")).grid:
        return image_tokens(cfg, height, width) * vision.get("spatial_merge_size", 2) ** 2
    side = vision.get("image_size", 336) // vision.get("patch_size", 14)
    return side * side + (0 if str(vision.get("model_type", "")).startswith("siglip") else 1)


def summary(cfg: dict, *, images: int, height: int, width: int, seq_len: int, micro_batch: int,
            optimizer_states: int, zero_shards: int, precision_bytes: int = 2) -> dict:
    """What a vision-language model adds to a plan: the parts' parameters, the image tokens of a sample, the vision
    tower's activations per micro-batch, and what freezing each part saves (its gradients, fp32 master weights and
    optimizer states: they are never allocated), whole and per rank of a ZeRO group of `zero_shards`."""
    parts = meta_parts(cfg)
    vision = cfg["vision_config"]
    hidden = vision.get("embed_dim") or vision.get("hidden_size")
    depth = vision.get("depth") or vision.get("num_hidden_layers")
    per_image = image_tokens(cfg, height, width)
    act = ACTIVATION_BYTES_PER_TOKEN_HIDDEN * vision_patches(cfg, height, width) * hidden * depth * images * micro_batch
    trainable_bytes = precision_bytes + 4 * (1 + optimizer_states)  # gradient + fp32 master + optimizer states
    return {"params": parts, "image_tokens_per_sample": per_image * images, "tokens_per_image": per_image,
            "seq_len": seq_len, "vision_activation_bytes": act * precision_bytes // 2,
            "freeze_saves_bytes": {p: n * trainable_bytes for p, n in parts.items()},
            "freeze_saves_bytes_per_rank": {p: n * trainable_bytes // max(1, zero_shards) for p, n in parts.items()}}


def render(info: dict, images: int, height: int, width: int) -> str:
    p, gb = info["params"], 1e9
    lines = [f"vision-language: vision tower {p['vision']:,} + projector {p['projector']:,} + language model "
             f"{p['language']:,} parameters (all counted in the plan below)",
             f"  {images} image(s) of {height}x{width} per sample = {info['image_tokens_per_sample']:,} image tokens "
             f"({info['tokens_per_image']:,} each) of the {info['seq_len']:,}-token sequence; the vision tower's "
             f"activations add ~{info['vision_activation_bytes'] / gb:.3f} GB per micro-batch"]
    if info["image_tokens_per_sample"] > info["seq_len"]:
        lines.append("  the image tokens alone exceed --seq-len: raise it, or lower the resolution")
    saves = info["freeze_saves_bytes"]
    per_rank = info["freeze_saves_bytes_per_rank"]
    lines.append("  freezing saves (gradients + fp32 master + optimizer states): " + ", ".join(
        f"{part} {saves[part] / gb:.3f} GB ({per_rank[part] / gb:.3f} GB per rank of a ZeRO-sharded group)"
        for part in PARTS))
    return "\n".join(lines) + "\n"
