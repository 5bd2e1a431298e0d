"""Rotary positions of packed vision-language rows (train.packing=document; harness/data/vision_pack.py).

A packed row holds several conversations; the data gives text position ids that restart at 0 at each one. LLaVA-style
families take them as they are. Qwen-VL families rotate by 3-D positions (temporal, height, width) that
`get_rope_index` computes from a sequence's image spans and their grids, counting from the sequence's start: here it
runs on each conversation alone, with that conversation's grids, and the pieces are laid side by side, so every
conversation gets the positions it would have in a row of its own. The result is transformers' packed layout
[4, batch, seq]: the text positions first (from which transformers finds the documents and keeps the attention
inside each: masking_utils.find_packed_sequence_indices, or flash-attention's varlen lengths), then the three rotary
rows.
"""

from __future__ import annotations

import itertools

import torch


def _runs(kinds: list[int]) -> dict[int, int]:
    """How many spans of each modality (1 image, 2 video) a conversation holds: get_rope_index's own grouping."""
    out: dict[int, int] = {}
    for kind, _ in itertools.groupby(kinds):
        if kind:
            out[kind] = out.get(kind, 0) + 1
    return out


def packed_rope(model, input_ids: torch.Tensor, text_positions: torch.Tensor, kinds: torch.Tensor,
                grids: dict[int, torch.Tensor | None], seconds: torch.Tensor | None = None) -> torch.Tensor:
    """[4, batch, seq] position ids: text positions, then get_rope_index per conversation (module docstring).
    kinds: mm_token_type_ids [batch, seq] (0 text, 1 image, 2 video); grids: each modality's [n, 3] grids in span
    order over the whole batch (None where there are none); seconds: each video's seconds per temporal patch, in the
    same order (Qwen2.5-VL's second_per_grid_ts; None: transformers' default)."""
    device = input_ids.device  # the loop runs on host copies: one transfer each way, not a sync per conversation
    input_ids, text_positions, kinds = input_ids.cpu(), text_positions.cpu(), kinds.cpu()
    grids = {kind: None if grid is None else grid.cpu() for kind, grid in grids.items()}
    seconds = None if seconds is None else seconds.cpu()
    batch, seq = input_ids.shape
    rope = torch.zeros(3, batch, seq, dtype=input_ids.dtype)
    used = {kind: 0 for kind in grids}
    names = {1: "image_grid_thw", 2: "video_grid_thw"}
    for b in range(batch):
        starts = (text_positions[b] == 0).nonzero().flatten().tolist() + [seq]
        for lo, hi in zip(starts, starts[1:]):
            args = {}
            for kind, count in _runs(kinds[b, lo:hi].tolist()).items():
                args[names[kind]] = grids[kind][used[kind]:used[kind] + count]
                if kind == 2 and seconds is not None:
                    args["second_per_grid_ts"] = seconds[used[kind]:used[kind] + count]
                used[kind] += count
            piece, _ = model.model.get_rope_index(input_ids[b:b + 1, lo:hi], mm_token_type_ids=kinds[b:b + 1, lo:hi],
                                                  **args)
            rope[:, b, lo:hi] = piece[:, 0]
    for kind, grid in grids.items():
        assert grid is None or used[kind] == len(grid), f"{used[kind]} spans of kind {kind}, {len(grid)} grids"
    return torch.cat([text_positions.to(rope.dtype).unsqueeze(0), rope]).to(device)
