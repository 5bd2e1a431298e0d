"""Gemma 3's attention masks for packed vision-language rows (train.packing=document; harness/data/vision_pack.py).

Gemma 3 lets each image's tokens attend to each other both ways (its token_type_ids mark them) on top of causal
attention, and its sliding layers keep that inside the window. transformers 5.25 builds the sliding mask as
create_causal_mask(or_mask_function=blockwise_overlay(block ids), and_mask_function=window); given a packed row's
position ids (restarting per conversation) it remaps q/kv to per-conversation positions for the WHOLE mask function,
the or_mask_function included, so a later conversation's image tokens look up the block ids at the first
conversation's offsets: wrong image blocks (a packed row's loss differed from one conversation per row by 4.9e-4,
gradients by 9e-3). The full-attention layers are right (their block ids are applied after the remap).

So for a packed Gemma 3 row the masks are built here, in row coordinates, and handed to the model as the prepared
{"full_attention": ..., "sliding_attention": ...} dict Gemma3Model accepts: for every layer
    same conversation AND (causal OR same image block), and for sliding layers also kv > q - sliding_window,
which is what transformers builds for one conversation per row (window distances are equal in row and conversation
coordinates inside one conversation). transformers' own mask interface renders it per attention implementation: a
[micro, 1, S, S] boolean mask (sdpa), an additive float one (eager), a BlockMask (flex_attention). flash-attention
cannot take it (its varlen kernels are causal only: the image blocks would silently lose their two-way attention),
so Gemma 3 under document packing is refused there (harness/model/attention.py).
"""

from __future__ import annotations

import torch

FULL, SLIDING = "full_attention", "sliding_attention"


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """[batch, seq] conversation index of each token: a new one wherever positions do not go up by one (transformers'
    find_packed_sequence_indices, without its None for a row of one conversation)."""
    first = position_ids[:, :1] - 1
    return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)


def image_blocks(token_type_ids: torch.Tensor) -> torch.Tensor:
    """[batch, seq] image block index of each image token (-1 for text): transformers' Gemma 3 grouping."""
    from transformers.models.gemma3.modeling_gemma3 import get_block_sequence_ids_for_mask

    return get_block_sequence_ids_for_mask(token_type_ids, device=token_type_ids.device)


def packed_masks(text_config, embeds: torch.Tensor, position_ids: torch.Tensor,
                 token_type_ids: torch.Tensor) -> dict:
    """The prepared mask dict for a packed Gemma 3 row (module docstring), for the implementation the config names."""
    from transformers.masking_utils import (and_masks, blockwise_overlay, create_causal_mask,
                                            packed_sequence_mask_function, sliding_window_overlay)

    implementation = text_config._attn_implementation
    assert not str(implementation).startswith("flash"), (
        f"{implementation} cannot express Gemma 3's image blocks in a packed row (refused before launch)")
    docs = document_ids(position_ids.expand(embeds.shape[0], -1))
    same_doc = packed_sequence_mask_function(docs)
    blocks = blockwise_overlay(image_blocks(token_type_ids))
    base = {"config": text_config, "inputs_embeds": embeds, "attention_mask": None, "cache": None,
            "position_ids": None}  # no positions: transformers must not remap (the defect above)
    masks = {FULL: create_causal_mask(**base, or_mask_function=blocks, and_mask_function=same_doc)}
    if SLIDING in set(getattr(text_config, "layer_types", ()) or ()):
        window = and_masks(same_doc, sliding_window_overlay(text_config.sliding_window))
        masks[SLIDING] = create_causal_mask(**base, or_mask_function=blocks, and_mask_function=window)
    return masks
