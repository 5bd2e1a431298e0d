"""Vision-language models in the planner (pure): which parameters are the vision tower's, the projector's and the
language model's (by name prefix, per family), their counts on the meta device, and the image tokens a sample adds.

The prefix table is the one fact harness/model/vision.py also reads (model.freeze, the start-up line), so the
planner's counts and the live model's are the same split by construction; tests/test_vision_language.py checks them
against the live model."""

from __future__ import annotations

from dataclasses import dataclass, replace

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


def vision_patches(cfg: dict, height: int, width: int) -> int:
    """Tokens the vision tower itself runs on for one image (before Qwen-VL's merger; LLaVA: patches + CLIP's CLS;
    Gemma 3: SigLIP's patches, no CLS)."""
    vision = cfg["vision_config"]
    if family_of(cfg.get("model_type")).grid:
        return image_tokens(cfg, height, width) * vision.get("spatial_merge_size", 2) ** 2
    side = vision.get("image_size", 336) // vision.get("patch_size", 14)
    return side * side + (0 if str(vision.get("model_type", "")).startswith("siglip") else 1)


def summary(cfg: dict, *, images: int, height: int, width: int, seq_len: int, micro_batch: int,
            optimizer_states: int, zero_shards: int, precision_bytes: int = 2, freeze: tuple = (),
            per_call: int = 8, checkpointing: bool = False) -> dict:
    """What a vision-language model adds to a plan: the parts' parameters, the image tokens of a sample, the vision
    tower's activations per micro-batch, and what freezing each part saves (its gradients, fp32 master weights and
    optimizer states: they are never allocated), whole and per rank of a ZeRO group of `zero_shards`."""
    parts = meta_parts(cfg)
    per_image = image_tokens(cfg, height, width)
    load = vision_load(cfg, images, height, width, freeze, per_call)
    act = activation_bytes(load, micro_batch, precision_bytes, checkpointing)
    trainable_bytes = precision_bytes + 4 * (1 + optimizer_states)  # gradient + fp32 master + optimizer states
    return {"params": parts, "image_tokens_per_sample": per_image * images, "tokens_per_image": per_image,
            "seq_len": seq_len, "vision_activation_bytes": act["saved"], "vision_transient_bytes": act["transient"],
            "freeze": list(freeze), "max_images_per_call": per_call,
            "freeze_saves_bytes": {p: n * trainable_bytes for p, n in parts.items()},
            "freeze_saves_bytes_per_rank": {p: n * trainable_bytes // max(1, zero_shards) for p, n in parts.items()}}


def render(info: dict, images: int, height: int, width: int) -> str:
    p, gb = info["params"], 1e9
    lines = [f"vision-language: vision tower {p['vision']:,} + projector {p['projector']:,} + language model "
             f"{p['language']:,} parameters (all counted in the plan below)",
             f"  {images} image(s) of {height}x{width} per sample = {info['image_tokens_per_sample']:,} image tokens "
             f"({info['tokens_per_image']:,} each) of the {info['seq_len']:,}-token sequence; the vision tower and "
             f"projector keep {info['vision_activation_bytes'] / gb:.3f} GB of activations per micro-batch for "
             f"backward{' (frozen: ' + ', '.join(info['freeze']) + ')' if info['freeze'] else ''}, and one call of "
             f"at most {info['max_images_per_call']} image(s) peaks at {info['vision_transient_bytes'] / gb:.3f} GB "
             "more (both in every layout's activations below)"]
    if info["image_tokens_per_sample"] > info["seq_len"]:
        lines.append("  the image tokens alone exceed --seq-len: raise it, or lower the resolution")
    saves = info["freeze_saves_bytes"]
    per_rank = info["freeze_saves_bytes_per_rank"]
    lines.append("  freezing saves (gradients + fp32 master + optimizer states): " + ", ".join(
        f"{part} {saves[part] / gb:.3f} GB ({per_rank[part] / gb:.3f} GB per rank of a ZeRO-sharded group)"
        for part in PARTS))
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class VisionLoad:
    """What one item (sequence) of a vision-language workload runs through the vision tower and projector, in the
    numbers activation_bytes needs; vision_load builds it from a model config."""

    images: int  # images per item
    patches: int  # tokens the tower runs on per image
    tokens: int  # image tokens per image (after Qwen-VL's merge)
    width: int  # the tower's hidden size
    block: int  # elements a tower block keeps per patch for backward (block_elems)
    depth: int
    pixel_elems: int  # input elements per patch (channels x temporal x patch^2)
    proj_elems: int  # elements the projector keeps for backward per image token
    out_width: int  # the language model's hidden size (the features' width)
    all_layers: bool  # LLaVA-style: the call returns every layer's hidden states (output_hidden_states), and one
    # of its `patches` is the class token (no pixels)
    trains_tower: bool
    trains_projector: bool
    per_call: int  # vision.max_images_per_call


def vision_load(cfg: dict, images: int, height: int, width: int, freeze=(), per_call: int = 8) -> VisionLoad:
    vision, family = cfg["vision_config"], family_of(cfg.get("model_type"))
    tower = vision.get("embed_dim") or vision.get("hidden_size")
    inter = vision.get("intermediate_size") or tower * vision.get("mlp_ratio", 4)
    text = cfg.get("text_config") or cfg
    out = vision.get("out_hidden_size") or (vision.get("hidden_size") if family.grid else None) or text["hidden_size"]
    patch, channels = vision.get("patch_size", 14), vision.get("in_channels", vision.get("num_channels", 3))
    if family.grid:  # merger: LayerNorm in and out, fc1 out and GELU out, each merge^2 x width per image token
        merge2 = vision.get("spatial_merge_size", 2) ** 2
        proj, pixel = 4 * merge2 * tower, channels * vision.get("temporal_patch_size", 2) * patch * patch
    else:  # linear_1 in (tower width), GELU in and linear_2 in (text width)
        proj, pixel = tower + 2 * out, channels * patch * patch
    return VisionLoad(images, vision_patches(cfg, height, width), image_tokens(cfg, height, width), tower,
                      block_elems(cfg, tower, inter), vision.get("depth") or vision.get("num_hidden_layers"), pixel,
                      proj, out, not family.grid, "vision" not in freeze, "projector" not in freeze, per_call)


def run_load(cfg: dict, images: int, pixel_elems: int, freeze=(), per_call: int = 8) -> VisionLoad:
    """A run's load from its data: the row of `images` images holding the most pixel elements (the vision store's
    worst row; per image, its patches as the processor cut them)."""
    load = vision_load(cfg, max(1, images), 28, 28, freeze, per_call)
    if not family_of(cfg.get("model_type")).grid:  # a fixed grid whatever the size; text only: the placeholder,
        return load  # a whole image (harness/model/vision.placeholder)
    merge2 = cfg["vision_config"].get("spatial_merge_size", 2) ** 2
    if not images:  # the placeholder: merge^2 patches, one token
        return replace(load, patches=merge2, tokens=1)
    patches = pixel_elems // load.pixel_elems // images
    return replace(load, patches=patches, tokens=patches // merge2)


GATED_TOWERS = ("qwen2_5_vl",)  # a SiLU-gated MLP in the tower (gate, up, act(gate), act * up)


def block_elems(cfg: dict, width: int, inter: int) -> int:
    """Elements a vision block keeps per patch for backward (sdpa attention: no scores), measured per term with
    autograd's saved-tensor hooks on the live towers (transformers 5.25, fp32, CPU): LayerNorm in and out twice,
    q, k, v and the attention output in its two layouts, 9 h (CLIP) or 11 h (Qwen-VL: one qkv tensor, q and k rotated,
    the per-image outputs concatenated); the MLP's fc1 output and its activation's, 2 i (gelu), 3 i (quick_gelu keeps
    its sigmoid too: Qwen2-VL, CLIP) or 4 i (a gated tower)."""
    vision = cfg["vision_config"]
    mlp = 4 if cfg.get("model_type") in GATED_TOWERS else 3 if vision.get("hidden_act") == "quick_gelu" else 2
    return (11 if family_of(cfg.get("model_type")).grid else 9) * width + mlp * inter


def activation_bytes(v: VisionLoad, micro_batch: int, lp: int, checkpointing: bool = False) -> dict:
    """Per rank and micro-batch: {"saved", "transient", "images"} bytes of the vision tower and projector.

    saved: kept from the vision calls until backward, for every image of the micro-batch (all calls run before
    the language model). A frozen tower records no graph (no parameter needs a gradient, nor do the pixels: the
    harness's forward runs it with autograd on, and autograd saves nothing there), so it keeps nothing; a trained
    one keeps every block's tensors and its patch embedding's pixels (with activation checkpointing, transformers'
    gradient_checkpointing_enable covers the tower's blocks too: each block's input). The projector keeps its
    inputs whenever it trains or the tower does.
    transient: the largest working set of one call, max_images_per_call images at most: a block's tensors being
    computed (and recomputed in backward under checkpointing), every layer's hidden states of a LLaVA-style call,
    and the features of all the micro-batch's images until they are merged into the embeddings. It comes and goes
    before the language model runs (memory.activation_bytes takes the larger of it and the language model's)."""
    images = v.images * micro_batch
    chunk = min(images, v.per_call)
    saved = 0
    if v.trains_tower:
        per_patch = (v.width if checkpointing else v.block) * v.depth + v.pixel_elems
        saved += images * (v.patches * per_patch - (v.pixel_elems if v.all_layers else 0))
    if v.trains_tower or v.trains_projector:
        saved += images * v.tokens * v.proj_elems
    working = chunk * v.patches * (v.block + (v.width * (v.depth + 1) if v.all_layers else 0))
    transient = working + images * v.tokens * v.out_width
    return {"saved": saved * lp, "transient": transient * lp, "images": images}
