"""Tiled MLP: each decoder layer's MLP runs over the sequence in tiles (DeepSpeed's TiledMLP, which recomputes
the MLP tile by tile in backward), so the intermediate activations (tokens x intermediate_size) of one tile exist
at a time. compute_params is always a list (DeepSpeed raises TypeError on None although its docstring allows it).
"""

from __future__ import annotations

import math


def _tiled_forward(mlp, tile_tokens: int):
    plain = type(mlp).forward  # the class's forward: the computation each tile runs

    def forward(x):
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

        tiles = max(1, math.ceil(x.shape[-2] / tile_tokens))
        if tiles == 1:
            return plain(mlp, x)
        return TiledMLP.apply(plain, mlp, x, tiles, list(mlp.parameters()))

    return forward


def decoder_mlps(model) -> list:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = base.get_decoder().layers
    return [layer.mlp for layer in layers]


def enable_tiled_mlp(model, tile_tokens: int) -> int:
    """Patch every decoder layer's MLP (instance forward); returns how many."""
    mlps = decoder_mlps(model)
    for mlp in mlps:
        mlp.forward = _tiled_forward(mlp, tile_tokens)
    return len(mlps)
