"""Qwen3-VL's deepstack features through the harness's own vision-language forward (harness/model/vision.py).

Qwen3-VL's vision tower gives, besides the image tokens' features, one more feature tensor per deepstack layer
(vision_config.deepstack_visual_indexes, each through its own merger). Its language model adds the k-th one into the
hidden states after decoder layer k, at the visual positions (Qwen3VLTextModel's `visual_pos_masks` and
`deepstack_visual_embeds`). transformers' Qwen3VLModel.forward computes both only from pixel_values it is given; the
harness passes inputs_embeds instead (its vision calls are its own, agreed across ranks), so it hands the language
model the same two arguments itself: `joint` builds them as Qwen3VLModel.forward does (images and videos laid side by
side in token order), `feeding` passes them to the language model's forward for the one call.

A placeholder vision call's deepstack features enter the loss as `0 * sum` with its main features (vision.py), so on
a rank without images the deepstack mergers take part in the backward with exact-zero gradients.
"""

from __future__ import annotations

import contextlib

import torch


def joint(masks: dict, deep: dict, dtype) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
    """(visual_pos_masks [batch, seq], one [visual tokens, hidden] tensor per deepstack layer) for the visuals
    scattered into a row: masks {kind: bool [batch, seq]}, deep {kind: [per visual: [per layer: tensor]]} in token
    order; None when the family has no deepstack layers or the row no visual."""
    kinds = [k for k in masks if deep[k] and deep[k][0]]
    if not kinds:
        return None
    visual = torch.zeros_like(masks[kinds[0]])
    for kind in kinds:
        visual = visual | masks[kind]
    layers = []
    for layer in range(len(deep[kinds[0]][0])):
        pieces = {k: torch.cat([v[layer] for v in deep[k]]).to(dtype) for k in kinds}
        if len(kinds) == 1:
            layers.append(pieces[kinds[0]])
            continue
        out = pieces[kinds[0]].new_zeros(int(visual.sum()), pieces[kinds[0]].shape[-1])
        for kind in kinds:
            out = out.index_put((masks[kind][visual],), pieces[kind])
        layers.append(out)
    return visual, layers


@contextlib.contextmanager
def feeding(model, stack):
    """Within the block, the model's language model receives `stack` (joint's result) as its visual_pos_masks and
    deepstack_visual_embeds (a forward pre-hook: transformers' own forward passes None for both when given
    inputs_embeds); nothing when stack is None."""
    if stack is None:
        yield
        return

    def hook(module, args, kwargs):
        kwargs["visual_pos_masks"], kwargs["deepstack_visual_embeds"] = stack
        return args, kwargs

    handle = model.model.language_model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()
