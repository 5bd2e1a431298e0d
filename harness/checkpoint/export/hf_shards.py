"""Sharded safetensors exactly as transformers' save_pretrained writes them, one shard in memory at a time.

The plan is huggingface_hub's split_torch_state_dict_into_shards (the function save_pretrained calls) run on
meta tensors: shapes and dtypes only, so planning reads no weights. It gives the same file names
(model-00001-of-0000N.safetensors, or model.safetensors when everything fits one shard) and index
(model.safetensors.index.json: metadata total_parameters + total_size, weight_map). write_sharded then
consumes (name, tensor) pairs in any order, keeps only the shards still being filled and writes each with
safetensors.torch.save_file (which writes from the tensors' memory, no copy) as soon as it is complete.
In the planning order at most two shards are open: the one being filled and a tensor larger than a shard.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import torch

from harness.errors import UsageError

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
FILENAME_PATTERN = "model{suffix}.safetensors"


def parse_shard_size(text: str | int) -> int:
    """'5GB', '200MB', or bytes -> bytes (huggingface_hub's parser: KB, MB, GB, TB are powers of 1000)."""
    from huggingface_hub.serialization._base import parse_size_to_int  # the parser save_pretrained uses

    try:
        size = text if isinstance(text, int) else parse_size_to_int(str(text))
    except ValueError as err:
        raise UsageError(f"--max-shard-size {text!r}: {err}\n    fix: a size like 5GB or 200MB (units KB, MB, GB, TB: powers of 1000)") from None
    if size <= 0:
        raise UsageError(f"--max-shard-size {text!r}: must be positive\n    fix: a size like 5GB or 200MB")
    return size


def plan_shards(specs: Iterable[tuple[str, tuple, torch.dtype]], max_shard_size: int | str):
    """(name, shape, dtype) in save order -> huggingface_hub StateDictSplit (filename_to_tensors,
    tensor_to_filename, metadata["total_size"], is_sharded)."""
    from huggingface_hub import split_torch_state_dict_into_shards

    meta = {name: torch.empty(shape, dtype=dtype, device="meta") for name, shape, dtype in specs}
    return split_torch_state_dict_into_shards(meta, filename_pattern=FILENAME_PATTERN,
                                              max_shard_size=parse_shard_size(max_shard_size))


def write_sharded(out: Path, split, tensors: Iterable[tuple[str, torch.Tensor]],
                  total_parameters: int) -> list[Path]:
    """Write the planned shards (and the index when there is more than one) into `out`."""
    from safetensors.torch import save_file

    out = Path(out)
    pending: dict[str, dict[str, torch.Tensor]] = {}
    written = []
    for name, tensor in tensors:
        filename = split.tensor_to_filename.get(name)
        if filename is None:
            raise ValueError(f"{name} is not in the shard plan")
        shard = pending.setdefault(filename, {})
        shard[name] = tensor.contiguous()
        if len(shard) == len(split.filename_to_tensors[filename]):
            save_file(shard, out / filename, metadata={"format": "pt"})
            written.append(out / filename)
            del pending[filename]
    if pending:
        missing = sorted(n for f, names in split.filename_to_tensors.items() if f in pending for n in names
                         if n not in pending[f])
        raise ValueError(f"tensors never produced: {missing[:5]}")
    if split.is_sharded:
        index = {"metadata": {"total_parameters": total_parameters, **split.metadata},
                 "weight_map": split.tensor_to_filename}
        (out / SAFE_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return written
