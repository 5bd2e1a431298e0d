"""Where a build by share reads its tensors: a safetensors checkpoint folder, or (presets) a seeded state dict.

A folder's key -> file map is `model.safetensors.index.json`'s weight_map, or the keys of its one
`model.safetensors`. Reading goes file by file, each opened once and closed before the next, so the file
pages a rank touches are mapped one file at a time; a row range of a tensor is read with safetensors'
`get_slice`, without the rest of the tensor (a column range still pages in the whole tensor).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from harness.errors import UsageError
from harness.model.load.slices import Request, owned

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class CheckpointFiles:
    """The tensors of a safetensors checkpoint folder, by key."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        index = self.folder / INDEX
        if index.is_file():
            self.weight_map = dict(json.loads(index.read_text())["weight_map"])
            self.where = str(index)
        elif (self.folder / SINGLE).is_file():
            from safetensors import safe_open

            with safe_open(self.folder / SINGLE, framework="pt") as f:
                self.weight_map = {key: SINGLE for key in f.keys()}
            self.where = str(self.folder / SINGLE)
        else:
            found = ", ".join(sorted(p.name for p in self.folder.iterdir() if p.is_file())) or "nothing"
            raise UsageError(f"cannot load {self.folder} by share: it has no {INDEX} and no {SINGLE} (found: {found})"
                             "\n    fix: re-save the model with save_pretrained (safetensors is its default), or use "
                             "a recipe without pipeline/tensor parallelism (those load through from_pretrained)")

    def keys(self) -> set[str]:
        return set(self.weight_map)

    def file_of(self, key: str) -> str:
        return str(self.folder / self.weight_map[key])

    def dtype(self) -> str | None:
        """The dtype of the checkpoint's floating-point tensors (the first one found), e.g. "bfloat16"."""
        from safetensors import safe_open

        names = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}
        for name in sorted(set(self.weight_map.values())):
            with safe_open(self.folder / name, framework="pt") as f:
                for key in f.keys():
                    if (kind := f.get_slice(key).get_dtype()) in names:
                        return names[kind]
        return None

    def read(self, requests: dict[str, Request], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
        """The owned part of each requested key, cast to `dtype` as it is read (one tensor converted at a time;
        None: as stored, for a caller that copies it into a tensor of the training dtype)."""
        from safetensors import safe_open

        by_file: dict[str, list[str]] = {}
        for key in requests:
            by_file.setdefault(self.weight_map[key], []).append(key)
        out = {}
        for name, keys in sorted(by_file.items()):
            with safe_open(self.folder / name, framework="pt") as f:
                for key in keys:
                    value = owned(f.get_slice(key), requests[key])
                    out[key] = (value if dtype is None else value.to(dtype)).contiguous()
        return out


class StateDictSource:
    """A preset's seeded weights as a source, so every path slices the same values (parity with one process)."""

    def __init__(self, state_dict: dict[str, torch.Tensor], name: str):
        self.state_dict, self.where = state_dict, f"the seeded weights of preset {name}"

    def keys(self) -> set[str]:
        return set(self.state_dict)

    def file_of(self, key: str) -> str:
        return self.where

    def dtype(self) -> str:
        return str(next(iter(self.state_dict.values())).dtype).removeprefix("torch.")

    def read(self, requests: dict[str, Request], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        return {key: owned(self.state_dict[key], req).to(dtype).clone().contiguous() for key, req in requests.items()}


def check_keys(source, model) -> None:
    """Every tensor the (meta) model loads is in the checkpoint, and the checkpoint holds nothing the model
    lacks; UsageError naming the keys and the file otherwise. Aliases of a tied weight (lm_head.weight when tied
    to the embedding) and keys the model declares ignorable (old rotary inv_freq) are accepted."""
    wanted = set(expected_keys(model))
    known = wanted | {n for n, _ in model.named_parameters(remove_duplicate=False)} | {n for n, _ in model.named_buffers()}
    ignore = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])]
    have = source.keys()
    missing = sorted(wanted - have)
    unexpected = sorted(k for k in have - known if not any(p.search(k) for p in ignore))
    problems = [f"missing key {k!r} (looked up in {source.where})" for k in missing[:5]]
    problems += [f"unexpected key {k!r} in {source.file_of(k)}" for k in unexpected[:5]]
    more = len(missing) + len(unexpected) - len(problems)
    if problems:
        raise UsageError(f"checkpoint {source.where} does not match the model built from its config "
                         f"({type(model).__name__}): " + "; ".join(problems) + (f"; and {more} more" if more else "")
                         + "\n    fix: use the folder save_pretrained wrote for this config (config.json and its "
                           "*.safetensors together), or a recipe without pipeline/tensor parallelism, whose "
                           "from_pretrained path tolerates renamed keys")


def expected_keys(model) -> list[str]:
    """The keys a model loads: each distinct parameter by its first name, and its persistent buffers."""
    keys = [n for n, _ in model.named_parameters()]
    for mod_name, module in model.named_modules():
        keys += [f"{mod_name}.{b}" if mod_name else b for b in module._buffers
                 if b not in module._non_persistent_buffers_set and module._buffers[b] is not None]
    return keys
