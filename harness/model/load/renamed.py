"""A checkpoint whose keys transformers renames at load (its conversion mapping), read under the model's names.

transformers 5 keeps older checkpoint layouts loadable by renaming keys as it reads them: a Qwen2-VL or LLaVA folder
stores `model.layers.*` / `visual.*` / `language_model.model.*` (the layout save_pretrained still writes), while the
model's parameters are `model.language_model.layers.*`, `model.visual.*`, ... from_pretrained applies those
renamings; a build by share (ZeRO-3 module by module, tensor parallel) reads the files itself, so this view applies
the same WeightRenaming rules (transformers' own table, get_model_conversion_mapping) to the key names. Renamings only:
a checkpoint that needs a tensor conversion (experts fused by a WeightConverter) keeps its own path (load/experts.py).
"""

from __future__ import annotations

import torch

from harness.model.load.slices import Request


class RenamedKeys:
    def __init__(self, source, to_stored: dict[str, str]):
        self.source, self.to_stored = source, to_stored  # model key -> the checkpoint's key
        self.where = source.where

    def keys(self) -> set[str]:
        return set(self.to_stored)

    def file_of(self, key: str) -> str:
        return self.source.file_of(self.to_stored[key])

    def dtype(self):
        return self.source.dtype()

    def read(self, requests: dict[str, Request], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
        got = self.source.read({self.to_stored[k]: r for k, r in requests.items()}, dtype)
        return {k: got[self.to_stored[k]] for k in requests}


def renamed_view(source, model):
    """`source` under the model's parameter names when transformers renames this family's keys; else itself."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key
    except ImportError:  # transformers 4: no conversion table, keys are stored as named
        return source
    rules = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    if not rules:
        return source
    wanted = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
    to_stored = {}
    for key in source.keys():
        new = key if key in wanted else rename_source_key(key, rules, [])[0]
        to_stored[new] = key
    return source if all(k == v for k, v in to_stored.items()) else RenamedKeys(source, to_stored)
