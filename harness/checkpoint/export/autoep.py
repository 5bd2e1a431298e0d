"""AutoEP checkpoints (DeepSpeed expert parallelism) -> transformers' fused expert tensors, lazily.

Under AutoEP each MoE layer's experts live in DeepSpeed's grouped module (<layer>.mlp.experts.w1/w2/w3, this
rank's experts only: w1 = gate_proj [E_local, I, H], w3 = up_proj, w2 = down_proj [E_local, H, I]; the router as
<layer>.mlp.router.gate.weight, also reachable as <layer>.mlp.gate.gate.weight). The checkpoint keeps one file
per expert, layer_{L}_expert_{e}_mp_rank_00_model_states.pt with <prefix>.w1.{e}, .w2.{e}, .w3.{e} (the
module's weights in the training dtype), and describes the layers in the model states' ds_autoep_layers
(module_path, num_experts, expert_key_prefix). The rest of the model is ordinary ZeRO state (ckpt_tensors).
Under ZeRO-3 there are no per-expert files: each ep rank's experts are read from its ranks' fp32 partitions
(_fused_zero3).
transformers' layout (repack_expert_weights in deepspeed/moe/ep_repack.py read backwards):
    gate_up_proj [E, 2I, H] = cat(w1[e], w3[e]) per expert, gate rows first;   down_proj [E, H, I] = w2[e]
Each fused tensor reads one slice per expert file when its shard is written: memory is one tensor, as for dense.

The names and the fusion here (hf_name/autoep_name, fuse_gate_up/split_gate_up) are the one mapping between AutoEP's
layer and transformers' MoE block; checkpoint/expert_layout.py applies the same to a universal checkpoint.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from harness.checkpoint.export import ckpt_tensors as ck
from harness.checkpoint.export.ckpt_tensors import Lazy, MappedFiles, lazy
from harness.errors import UsageError
from harness.config import moe_families

EXPERT_PARAM = re.compile(r"\.experts\.w[123]$")  # DeepSpeed's expert_parameter_patterns for AutoEP
GATE_UP, DOWN = "experts.gate_up_proj", "experts.down_proj"  # transformers' fused tensors under a MoE block
W1, W2, W3 = "experts.w1", "experts.w2", "experts.w3"  # AutoEP's GroupedExperts (gate, down, up)


def fuse_gate_up(w1: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    """[..., I, H] gate and up -> transformers' [..., 2I, H], gate rows first (one expert or all of them)."""
    return torch.cat([w1, w3], dim=-2)


def split_gate_up(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' [..., 2I, H] -> AutoEP's (w1, w3), each [..., I, H]."""
    w1, w3 = gate_up.chunk(2, dim=-2)
    return w1.contiguous(), w3.contiguous()


def renames(family) -> list[tuple[str, str]]:
    """(AutoEP suffix, transformers suffix) under one MoE block for what is not a routed expert. AutoEPMoELayer
    (deepspeed/module_inject/auto_ep_layer.py) keeps the router as router.gate, the shared experts as
    shared_experts / shared_experts_gate; the block's own attribute names come from the family's AutoEP preset."""
    from deepspeed.module_inject.auto_ep_presets.registry import get_preset

    preset = get_preset(family.autoep_preset)
    out = [("router.gate.", f"{family.router}.")]
    if preset.has_shared_experts and preset.shared_experts_pattern:
        out.append(("shared_experts.", f"{preset.shared_experts_pattern}."))
    if preset.shared_experts_gate_pattern:
        out.append(("shared_experts_gate.", f"{preset.shared_experts_gate_pattern}."))
    return out


def _block(name: str, blocks) -> tuple[str, str] | None:
    for block in blocks:
        if name.startswith(block + "."):
            return block, name[len(block) + 1:]
    return None


def hf_name(name: str, blocks, family) -> str | None:
    """An AutoEP training name -> transformers' (None: the router again under its HF attribute, an alias AutoEP
    adds: <block>.<router>.gate.*). Routed experts (w1/w2/w3) are not renamed here: they are fused."""
    found = _block(name, blocks)
    if found is None:
        return name
    block, rest = found
    if rest.startswith(f"{family.router}.gate."):
        return None
    for autoep, hf in renames(family):
        if rest.startswith(autoep):
            return f"{block}.{hf}{rest[len(autoep):]}"
    return name


def autoep_name(name: str, blocks, family) -> str:
    """transformers' name under a MoE block -> AutoEP's (the inverse of hf_name for what is not a routed expert)."""
    found = _block(name, blocks)
    if found is None:
        return name
    block, rest = found
    for autoep, hf in renames(family):
        if rest.startswith(hf):
            return f"{block}.{autoep}{rest[len(hf):]}"
    return name


def _model_states(tag_dir: Path) -> Path:
    plain = tag_dir / "mp_rank_00_model_states.pt"
    return plain if plain.is_file() else tag_dir / "zero_pp_rank_0_mp_rank_00_model_states.pt"


def layers(files: MappedFiles, tag_dir: Path) -> list[dict]:
    """The checkpoint's AutoEP layer records (empty: not an AutoEP checkpoint)."""
    path = _model_states(tag_dir)
    return list(files[path].get("ds_autoep_layers") or []) if path.is_file() else []


def _renamed(tag_dir: Path, found: list[dict], dense: dict[str, Lazy]) -> dict[str, Lazy]:
    """`dense` under transformers' names, the grouped experts left out."""
    family = moe_families.family_of(json.loads((tag_dir.parent / "hf" / "config.json").read_text()))
    blocks = [layer["module_path"] for layer in found]
    out = {}
    for key, value in dense.items():
        name = None if EXPERT_PARAM.search(key) else hf_name(key, blocks, family)
        if name is not None:
            out[name] = value
    return out


def _fused_zero3(files: MappedFiles, tag_dir: Path, found: list[dict]) -> dict[str, Lazy]:
    """AutoEP under ZeRO-3 writes no per-expert files (expert_state_format "zero3_partitioned"): every rank's
    zero_pp_rank_R model states carry param_shapes with its own experts' w1/w2/w3 [E_local, ...] and a
    ds_autoep_layers record naming its ep_rank and expert_data_parallel_rank; its fp32_flat_groups hold
    ceil(numel / edp) elements of each expert tensor (partitioned over the expert-data-parallel group) and
    ceil(numel / world) of every other one, in param_shapes order. An expert tensor is the edp ranks' slices of
    one ep rank, cut to numel; the ep ranks' tensors stacked in ep order are all experts."""
    paths, models = ck.rank_files(tag_dir, "optim", 0), ck.rank_files(tag_dir, "model", 0)
    if not found or len(paths) != len(models):
        raise UsageError(f"{tag_dir}: {len(paths)} optimizer-state and {len(models)} model-state files, AutoEP "
                         f"layers {len(found)}\n    fix: export a checkpoint whose save finished on every rank")
    edp = int(found[0]["expert_data_parallel_world_size"])
    size_of = lambda name: edp if EXPERT_PARAM.search(name) else len(paths)  # noqa: E731
    dense = ck.zero3_source(files, tag_dir, 0, size_of, leave_out=lambda name: bool(EXPERT_PARAM.search(name)))
    out = _renamed(tag_dir, found, dense)
    records = [{r["module_path"]: r for r in files[m]["ds_autoep_layers"]} for m in models]
    offsets = [ck.zero3_offsets(files[m], size_of) for m in models]
    for layer in found:
        path, prefix, ep = layer["module_path"], layer["expert_key_prefix"], int(layer["ep_size"])
        groups = [sorted((r for r in range(len(models)) if records[r][path]["ep_rank"] == k),
                         key=lambda r: records[r][path]["expert_data_parallel_rank"]) for k in range(ep)]
        starts = [records[g[0]][path]["global_expert_start"] for g in groups if g]
        if any(len(g) != edp for g in groups) or starts != [k * int(layer["num_local_experts"]) for k in range(ep)]:
            raise UsageError(f"{tag_dir}: {path}'s experts are on ranks {groups} by ep rank; expected {edp} each, "
                             f"holding experts from {starts} (a uniform placement)\n    fix: export a checkpoint whose"
                             " save finished on every rank, trained with AutoEP's default (uniform) expert placement")

        def part(k: int, w: str, groups=groups, prefix=prefix) -> torch.Tensor:
            start, per_rank, shape = offsets[groups[k][0]][f"{prefix}.{w}"]
            return ck.zero3_gathered(files, [paths[r] for r in groups[k]], start, per_rank, shape).read()

        def gate_up(ep=ep, part=part) -> torch.Tensor:
            return torch.cat([fuse_gate_up(part(k, "w1"), part(k, "w3")) for k in range(ep)])

        def down(ep=ep, part=part) -> torch.Tensor:
            return torch.cat([part(k, "w2") for k in range(ep)])

        local, inter, hidden = offsets[0][f"{prefix}.w1"][2]
        count = local * ep
        out[f"{prefix}.gate_up_proj"] = Lazy((count, 2 * inter, hidden), gate_up)
        out[f"{prefix}.down_proj"] = Lazy((count, hidden, inter), down)
    return out


def _expert_file(tag_dir: Path, layer: dict, expert: int) -> Path:
    return tag_dir / f"layer_{layer['moe_layer_id']}_expert_{expert}_mp_rank_00_model_states.pt"


def fused_state(files: MappedFiles, tag_dir: Path, dense: dict[str, Lazy], zero_stage: int) -> dict[str, Lazy]:
    """`dense` (the ZeRO source of the same checkpoint) with the grouped experts and the AutoEP router replaced by
    transformers' names and fused tensors (ZeRO-3: `dense` is not used, the partitions are read here)."""
    found = layers(files, tag_dir)
    if zero_stage == 3:
        return _fused_zero3(files, tag_dir, found)
    out = _renamed(tag_dir, found, dense)
    for layer in found:
        prefix, count = layer["expert_key_prefix"], int(layer["num_experts"])
        paths = [_expert_file(tag_dir, layer, e) for e in range(count)]
        missing = [p.name for p in paths if not p.is_file()]
        if missing:
            raise UsageError(f"{tag_dir}: AutoEP expert files missing: {missing[:4]} ({len(missing)} of {count})\n"
                             "    fix: export a checkpoint whose save finished on every rank")
        w1 = files[paths[0]][f"{prefix}.w1.0"]  # [I, H]
        inter, hidden = w1.shape

        def gate_up(paths=paths, prefix=prefix) -> torch.Tensor:
            return torch.stack([fuse_gate_up(files[p][f"{prefix}.w1.{e}"], files[p][f"{prefix}.w3.{e}"])
                                for e, p in enumerate(paths)])

        def down(paths=paths, prefix=prefix) -> torch.Tensor:
            return torch.stack([files[p][f"{prefix}.w2.{e}"] for e, p in enumerate(paths)])

        out[f"{prefix}.gate_up_proj"] = lazy(files, (count, 2 * inter, hidden), gate_up)
        out[f"{prefix}.down_proj"] = lazy(files, (count, hidden, inter), down)
    return out
