"""Shared export assertions: the streamed folder's tensors against DeepSpeed's own reading of the checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch

from harness.checkpoint.export.hf_shards import SAFE_INDEX, SAFE_WEIGHTS


def read_sharded(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of an exported folder (or one save_pretrained wrote), one at a time, memory-mapped."""
    from safetensors import safe_open

    folder = Path(folder)
    index = folder / SAFE_INDEX
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else [SAFE_WEIGHTS]
    for filename in files:
        with safe_open(folder / filename, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def engine_weights(run) -> dict:
    """The engine's weights as DeepSpeed itself reads them back: zero_to_fp32 for ZeRO-1/2/3 (the fp32
    masters), the model-states module for ZeRO-0. Whole-model, for tiny test checkpoints only."""
    from harness.checkpoint.export.state import find_checkpoint

    ref = find_checkpoint(run)
    if ref.manifest()["zero_stage"] == 0:
        states = torch.load(ref.tag_dir / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=True)
        return states["module"]
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(ref.ckpt_dir), tag=ref.tag)


def assert_export_equals_engine(run, out: Path, max_shard_size: str = "64KB") -> dict:
    """Export in several shards; every written tensor equals the engine's exactly (fp32); the index maps every
    tensor to a file that holds it; the folder loads."""
    from transformers import AutoModelForCausalLM

    from harness.checkpoint.export.folder import export

    info = export(run, out, max_shard_size=max_shard_size)
    assert info["shards"] > 1, info
    got, want = dict(read_sharded(out)), engine_weights(run)
    assert got and set(got) <= set(want), sorted(set(got) - set(want))
    unequal = [k for k, v in got.items() if not torch.equal(v, want[k].to(v.dtype))]
    assert not unequal, f"exported tensors differ from the engine's: {unequal[:5]}"
    index = json.loads((out / SAFE_INDEX).read_text())
    assert set(index["weight_map"]) == set(got) and index["metadata"]["total_size"] == info["total_size_bytes"]
    AutoModelForCausalLM.from_pretrained(out)
    return info
