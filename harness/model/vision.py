"""Vision-language models (AutoModelForImageTextToText: Qwen2-VL / Qwen2.5-VL / Qwen3-VL, LLaVA(-Next), Gemma 3, ...):
the parts (vision tower, projector, language model), model.freeze, and the forward every rank runs.

Why a forward of our own. ZeRO-3 gathers a module's parameters each time the module runs, and ZeRO-1/2 reduce a
gradient for every parameter that has one. transformers' forward calls the vision tower only when the micro-batch
has an image, so a rank with text only and a rank with an image run different collectives: gloo aborts ("collective
mismatch"), NCCL hangs. Here every rank calls the vision tower exactly `num_calls` times per micro-batch (the
trainer agrees on the number across ranks first: harness/train/vision_steps.py); a call with no real image runs on a
tiny placeholder image, and its output enters the graph as `embeds + 0 * features.sum()`: the forward values are
unchanged bit for bit (x + 0 == x) and the placeholder's gradient is exactly zero, while every vision parameter
still takes part in the backward on every rank. Then the same module sequence runs everywhere: embeddings, the
vision tower `num_calls` times, the language model, the head. Videos (Qwen2-VL / Qwen2.5-VL: frames grouped in time,
harness/data/video.py) go through the same calls as the images, concatenated with them (a video counts one unit of
vision.max_images_per_call per temporal patch), and their features fill the video tokens.
"""

from __future__ import annotations

import types

import torch

from harness.data.video import IMAGE, VIDEO
from harness.data.vision import Images  # noqa: F401 (what vl_forward takes)
from harness.model import deepstack
from harness.planner.vision import PARTS, parts_count as _parts_count, family_of as _family_of  # noqa: F401


def is_vision_language(config) -> bool:
    return getattr(config, "vision_config", None) is not None


def family_of(config):
    """The family's parts and feeding (harness/planner/vision.py's table)."""
    return _family_of(getattr(config, "model_type", ""))


def image_token_id(config) -> int:
    token = getattr(config, "image_token_id", None)
    return token if token is not None else config.image_token_index


def parts_count(named_params, config) -> dict[str, int]:
    return _parts_count(named_params, getattr(config, "model_type", ""))


def freeze(model, parts) -> int:
    """requires_grad False on the named parts (model.freeze); the number of parameters frozen."""
    family, frozen = family_of(model.config), 0
    for name, param in model.named_parameters():
        if family.part_of(name) in parts:
            param.requires_grad_(False)
            frozen += getattr(param, "ds_numel", param.numel())
    return frozen


def lora_targets(model, target_modules, parts) -> list[str]:
    """The modules LoRA goes on in a vision-language model (vision.lora): the language model's modules whose names
    end with one of adapter.target_modules ("language"), every Linear layer of the projector ("projector"); never
    the vision tower. Full module names, so peft matches exactly these (a CLIP tower's q_proj is not one)."""
    from harness.errors import UsageError

    family, found = family_of(model.config), {"language": [], "projector": []}
    for name, module in model.named_modules():
        part = family.part_of(name + ".")
        if part == "language" and any(name == s or name.endswith("." + s) for s in target_modules):
            found[part].append(name)
        elif part == "projector" and isinstance(module, torch.nn.Linear):
            found[part].append(name)
    if "projector" in parts and not found["projector"]:
        raise UsageError(f"vision.lora includes projector but the projector of this {model.config.model_type} model "
                         "has no Linear layer to adapt (Gemma 3's is one weight matrix and a norm)\n    fix: train "
                         'the projector in full (adapter.modules_to_save=["multi_modal_projector"]) with '
                         'vision.lora=["language"]')
    if "language" in parts and not found["language"]:
        raise UsageError(f"vision.lora includes language but no module of the language model ends with "
                         f"adapter.target_modules {list(target_modules)}\n    fix: name its projections "
                         "(q_proj, v_proj, ...) in adapter.target_modules")
    return [name for part in PARTS if part in parts for name in found.get(part, [])]


def placeholder(config, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The smallest image the family's vision tower takes: (pixels, grid or None), zeros."""
    vision = config.vision_config
    if family_of(config).grid:
        merge = vision.spatial_merge_size
        dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
        return torch.zeros(merge * merge, dim, dtype=dtype), torch.tensor([[1, merge, merge]])
    size = vision.image_size
    return torch.zeros(1, getattr(vision, "num_channels", 3), size, size, dtype=dtype), None


def _rows(feats) -> torch.Tensor:
    feats = torch.cat(list(feats), dim=0) if isinstance(feats, (list, tuple)) else feats
    return feats.reshape(-1, feats.shape[-1])


def tower(model, pixels: torch.Tensor, grid: torch.Tensor | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One call of the vision tower (+ projector) on a chunk of images: their tokens' features, concatenated, and
    Qwen3-VL's deepstack features (one [tokens, hidden] tensor per deepstack layer, in the same token order; an
    empty list for the other families)."""
    config = model.config
    if grid is not None:
        out = model.model.get_image_features(pixel_values=pixels, image_grid_thw=grid, return_dict=True)
    elif not hasattr(config, "vision_feature_layer"):  # Gemma 3: the last layer, pooled by its projector
        out = model.model.get_image_features(pixel_values=pixels, return_dict=True)
    else:
        out = model.model.get_image_features(pixel_values=pixels,
                                             vision_feature_layer=config.vision_feature_layer,
                                             vision_feature_select_strategy=config.vision_feature_select_strategy,
                                             return_dict=True)
    return _rows(out.pooler_output), [_rows(d) for d in getattr(out, "deepstack_features", None) or ()]


def image_features(model, pixels: torch.Tensor, grid: torch.Tensor | None) -> torch.Tensor:
    """One call's image-token features (tower without the deepstack features)."""
    return tower(model, pixels, grid)[0]


def num_chunks(images: Images, per_call: int) -> int:
    """Vision-tower calls a micro-batch with these images and videos needs (Images.calls): at least one (the
    placeholder)."""
    return max(1, len(images.calls(per_call)))


def _split(model, feats: torch.Tensor, images: Images, group: list[int]) -> list[torch.Tensor]:
    """One call's features back into one piece per visual (an image's or a video's tokens)."""
    if not images.grids:
        return list(feats.reshape(len(group), -1, feats.shape[-1]))
    merge = model.config.vision_config.spatial_merge_size ** 2
    return list(feats.split([int(images.grids[i].prod()) // merge for i in group]))


def _merge(model, embeds, input_ids, images: Images, num_calls: int, per_call: int):
    """The vision tower `num_calls` times: each call takes a group of images and videos together (Images.calls),
    the rest run on the placeholder; image features go to the image tokens, video features to the video tokens.
    Returns the embeddings and Qwen3-VL's deepstack input for its language model (harness/model/deepstack.py;
    None for the other families and for a row without images)."""
    device, dtype = embeds.device, embeds.dtype
    groups = images.calls(per_call)
    assert len(groups) <= num_calls, f"{len(groups)} vision calls needed, {num_calls} agreed"
    real, deep, zero = {IMAGE: [], VIDEO: []}, {IMAGE: [], VIDEO: []}, None
    for i in range(num_calls):
        pixels, grid = images.batch(groups[i]) if i < len(groups) else placeholder(model.config, dtype)
        feats, layers = tower(model, pixels.to(device, dtype), None if grid is None else grid.to(device))
        if i < len(groups):
            pieces = [_split(model, f, images, groups[i]) for f in (feats, *layers)]
            for k, j in enumerate(groups[i]):
                real[images.kind(j)].append(pieces[0][k])
                deep[images.kind(j)].append([p[k] for p in pieces[1:]])
        else:  # the placeholder, deepstack layers included: in the graph, adds exactly nothing (module docstring)
            for f in (feats, *layers):
                zero = f.sum() * 0.0 if zero is None else zero + f.sum() * 0.0
    masks = {}
    for kind, token in ((IMAGE, image_token_id(model.config)), (VIDEO, getattr(model.config, "video_token_id", None))):
        if real[kind]:
            masks[kind] = (input_ids == token).to(device)
            feats, count = torch.cat(real[kind]).to(dtype), int(masks[kind].sum())
            assert count == feats.shape[0], f"{count} {kind} tokens, {feats.shape[0]} features"
            embeds = embeds.masked_scatter(masks[kind].unsqueeze(-1), feats)
    return (embeds if zero is None else embeds + zero.to(dtype)), deepstack.joint(masks, deep, dtype)


def rope_positions(model, input_ids, images: Images, text_positions=None):
    """Qwen-VL's 3-D rotary positions from the images' and videos' grids (transformers' get_rope_index; Qwen2.5-VL
    spaces a video's temporal positions by its seconds per temporal patch); per conversation where a packed row's
    text positions are given (train.packing=document: harness/model/vision_positions.py)."""
    config, device = model.config, input_ids.device
    video_token = getattr(config, "video_token_id", None)
    types = (input_ids == image_token_id(config)).int()
    if video_token is not None:
        types = types + VIDEO * (input_ids == video_token).int()
    by_kind = {k: [i for i in range(len(images)) if images.kind(i) == k] for k in (IMAGE, VIDEO)}
    grids = {k: torch.stack([images.grids[i] for i in v]).to(device) if v else None for k, v in by_kind.items()}
    extra = {}
    if by_kind[VIDEO]:
        extra["second_per_grid_ts"] = torch.tensor([images.seconds[i] for i in by_kind[VIDEO]], device=device)
    if text_positions is not None:
        from harness.model.vision_positions import packed_rope

        return packed_rope(model, input_ids, text_positions.to(device), types, grids, extra.get("second_per_grid_ts"))
    position_ids, _ = model.model.get_rope_index(input_ids, mm_token_type_ids=types, image_grid_thw=grids[IMAGE],
                                                 video_grid_thw=grids[VIDEO], **extra)
    return position_ids


def vl_forward(self, input_ids, labels=None, images: Images | None = None, num_calls: int = 1, per_call: int = 8,
               position_ids=None, **kwargs):
    """The forward every rank runs (module docstring): kwargs go to transformers' own forward (use_cache,
    num_items_in_batch). position_ids: a packed row's text positions, restarting per conversation (train.packing
    document): LLaVA-style families take them as they are, Qwen-VL's 3-D ones are computed per conversation."""
    images = images if images is not None else Images([], [])
    embeds = self.get_input_embeddings()(input_ids)
    embeds, stack = _merge(self, embeds, input_ids, images, num_calls, per_call)
    if hasattr(self.model, "rope_deltas"):  # generation state: left over, it would shift a text-only row's positions
        self.model.rope_deltas = None
    if family_of(self.config).grid and (len(images) or position_ids is not None):  # 3-D rotary positions
        position_ids = rope_positions(self, input_ids, images, position_ids)
    if family_of(self.config).token_types:  # Gemma 3: each image's tokens attend to each other (as its processor)
        kwargs["token_type_ids"] = (input_ids == image_token_id(self.config)).long()
        if position_ids is not None:  # a packed row: transformers would mix up the image blocks (vision_masks.py)
            from harness.model.vision_masks import packed_masks

            kwargs["attention_mask"] = packed_masks(self.config.get_text_config(), embeds, position_ids,
                                                    kwargs["token_type_ids"])
    with deepstack.feeding(self, stack):  # Qwen3-VL: its deepstack features into its first language layers
        return type(self).forward(self, inputs_embeds=embeds, position_ids=position_ids, labels=labels, **kwargs)


def install(model, freeze_parts=()) -> str:
    """The harness's forward on this model object (names and checkpoints unchanged) and model.freeze; the start-up
    note."""
    model.forward = types.MethodType(vl_forward, model)
    frozen = freeze(model, freeze_parts) if freeze_parts else 0
    counts = parts_count(model.named_parameters(), model.config)
    note = (f"vision-language ({family_of(model.config).name}): vision {counts['vision'] / 1e6:.3f}M, projector "
            f"{counts['projector'] / 1e6:.3f}M, language {counts['language'] / 1e6:.3f}M params")
    if freeze_parts:
        note += f"; frozen: {', '.join(freeze_parts)} ({frozen / 1e6:.3f}M)"
    return note


def load_image_processor(model: str, config):
    """The model folder's (or hub id's) image processor: AutoImageProcessor, which picks the PIL backend when
    torchvision is missing (transformers 5: the Qwen2-VL *Processor* needs torchvision for its video half; the
    harness needs only the image half). A vision-language model without one is an error with the fix."""
    from transformers import AutoImageProcessor

    from harness.errors import UsageError

    try:
        processor = AutoImageProcessor.from_pretrained(model)
    except (OSError, ValueError, ImportError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise UsageError(f"train.model {model} is a vision-language model ({config.model_type}) but its image "
                         f"processor cannot be loaded: {first}\n    fix: the folder needs the processor's "
                         "preprocessor_config.json (image_processor.save_pretrained(dir) or "
                         "processor.save_pretrained(dir)); a text-only tokenizer folder is not enough") from None
    if getattr(processor, "do_pan_and_scan", False):  # Gemma 3's crops: a variable number of image blocks per image
        raise UsageError(f"train.model {model}: its image processor has do_pan_and_scan true (Gemma 3's extra crops "
                         "per image), which the harness does not expand into image blocks\n    fix: set "
                         '"do_pan_and_scan": false in its preprocessor_config.json')
    return processor
