"""AutoEP checkpoints (DeepSpeed expert parallelism) -> transformers' fused expert tensors, lazily.

Under AutoEP each MoE layer's experts live in DeepSpeed's grouped module (<layer>.mlp.experts.w1/w2/w3, this
rank's experts only: w1 = gate_proj [E_local, I, H], w3 = up_proj, w2 = down_proj [E_local, H, I]; the router as
<layer>.mlp.router.gate.weight, also reachable as <layer>.mlp.gate.gate.weight). The checkpoint keeps one file
per expert, layer_{L}_expert_{e}_mp_rank_00_model_states.pt with <prefix>.w1.{e}, .w2.{e}, .w3.{e} (the
module's weights in the training dtype), and describes the layers in the model states' ds_autoep_layers
(module_path, num_experts, expert_key_prefix). The rest of the model is ordinary ZeRO state (ckpt_tensors).
transformers' layout (repack_expert_weights in deepspeed/moe/ep_repack.py read backwards):
    gate_up_proj [E, 2I, H] = cat(w1[e], w3[e]) per expert, gate rows first;   down_proj [E, H, I] = w2[e]
Each fused tensor reads one slice per expert file when its shard is written: memory is one tensor, as for dense.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from harness.checkpoint.export.ckpt_tensors import Lazy, MappedFiles, lazy
from harness.errors import UsageError

EXPERT_PARAM = re.compile(r"\.experts\.w[123]$")  # DeepSpeed's expert_parameter_patterns for AutoEP


def _model_states(tag_dir: Path) -> Path:
    plain = tag_dir / "mp_rank_00_model_states.pt"
    return plain if plain.is_file() else tag_dir / "zero_pp_rank_0_mp_rank_00_model_states.pt"


def layers(files: MappedFiles, tag_dir: Path) -> list[dict]:
    """The checkpoint's AutoEP layer records (empty: not an AutoEP checkpoint)."""
    path = _model_states(tag_dir)
    return list(files[path].get("ds_autoep_layers") or []) if path.is_file() else []


def _expert_file(tag_dir: Path, layer: dict, expert: int) -> Path:
    return tag_dir / f"layer_{layer['moe_layer_id']}_expert_{expert}_mp_rank_00_model_states.pt"


def fused_state(files: MappedFiles, tag_dir: Path, dense: dict[str, Lazy], zero_stage: int) -> dict[str, Lazy]:
    """`dense` (the ZeRO source of the same checkpoint) with the grouped experts and the AutoEP router replaced by
    transformers' names and fused tensors."""
    found = layers(files, tag_dir)
    if zero_stage == 3:
        raise UsageError(f"{tag_dir}: exporting an AutoEP checkpoint trained under ZeRO-3 is not implemented (its "
                         "expert weights are partitioned inside the optimizer groups)\n    fix: export a ZeRO-1/2 "
                         "AutoEP checkpoint, or train the MoE model on ZeRO-3 without parallel.expert")
    out = {k: v for k, v in dense.items() if not EXPERT_PARAM.search(k)}
    for layer in found:
        path, prefix, count = layer["module_path"], layer["expert_key_prefix"], int(layer["num_experts"])
        out.pop(f"{path}.gate.gate.weight", None)  # the same router under a second name
        router = out.pop(f"{path}.router.gate.weight", None)
        if router is not None:
            out[f"{path}.gate.weight"] = router
        paths = [_expert_file(tag_dir, layer, e) for e in range(count)]
        missing = [p.name for p in paths if not p.is_file()]
        if missing:
            raise UsageError(f"{tag_dir}: AutoEP expert files missing: {missing[:4]} ({len(missing)} of {count})\n"
                             "    fix: export a checkpoint whose save finished on every rank")
        w1 = files[paths[0]][f"{prefix}.w1.0"]  # [I, H]
        inter, hidden = w1.shape

        def gate_up(paths=paths, prefix=prefix) -> torch.Tensor:
            return torch.stack([torch.cat([files[p][f"{prefix}.w1.{e}"], files[p][f"{prefix}.w3.{e}"]])
                                for e, p in enumerate(paths)])

        def down(paths=paths, prefix=prefix) -> torch.Tensor:
            return torch.stack([files[p][f"{prefix}.w2.{e}"] for e, p in enumerate(paths)])

        out[f"{prefix}.gate_up_proj"] = lazy(files, (count, 2 * inter, hidden), gate_up)
        out[f"{prefix}.down_proj"] = lazy(files, (count, hidden, inter), down)
    return out
