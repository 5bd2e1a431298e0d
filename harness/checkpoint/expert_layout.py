"""A universal checkpoint of a MoE model, rewritten for the expert layout of the launch that loads it.

DeepSpeed's ds_to_universal writes one folder per trained parameter, universal/<tag>/zero/<name>/ with fp32.pt,
exp_avg.pt, exp_avg_sq.pt ({"param": the whole tensor, ...}) and step.pt, named as the saving engine named its
parameters. An AutoEP run (parallel.expert > 1) names a MoE block's experts <block>.experts.w1/w2/w3 ([E, I, H] gate,
[E, H, I] down, [E, I, H] up, all E experts gathered; marked is_expert_param with ep_num_experts) and its router
<block>.router.gate.weight; a launch without AutoEP trains transformers' fused <block>.experts.gate_up_proj
[E, 2I, H] (gate rows first) and down_proj, and <block>.gate.weight. Each side's engine looks for its own names only
(universal_checkpoint.load_hp_checkpoint_state: FileNotFoundError otherwise), so rank 0 rewrites the folder to the
layout this launch trains, every optimizer state alike, with export/autoep.py's mapping (the one source of both
names and fusion):

- to transformers' layout (EP n -> EP 1): w1 + w3 -> gate_up_proj, w2 -> down_proj, the expert marks dropped (they
  would make DeepSpeed slice the tensor by an expert group left from an earlier job in the process); router and
  shared experts renamed; AutoEP's alias of the router (<block>.gate.gate.weight, fp32 only) removed; the optimizer's
  expert param groups (moe: true, appended by DeepSpeed after the dense ones) dropped from optimizer_state.pt.
- to AutoEP's layout (EP 1 -> EP n): the inverse, every expert tensor whole ([E, ...]) with ep_num_experts, which
  DeepSpeed's AutoEP restore slices per EP rank (the router's alias written again); one expert group per dense
  group appended (DeepSpeed reads the param groups pairwise with its own: a missing one would leave the experts'
  optimizer state unloaded).

The rewrite is its own inverse, so one conversion serves launches on any expert degree: converted.json records
the layout the folder is in and a launch on the other one rewrites it again (rank 0, before the others load).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from harness.checkpoint.export import autoep

HF, AUTOEP = "transformers", "autoep"
FORMS = (HF, AUTOEP)
FORM = "experts"  # converted.json: which layout the zero/ folders are in
IS_EXPERT, NUM_EXPERTS = "is_expert_param", "ep_num_experts"  # deepspeed.checkpoint.constants


def form(marker: dict) -> str:
    return marker.get(FORM, HF)


def _blocks(zero: Path, suffix: str) -> list[str]:
    return sorted(p.name[:-len(suffix) - 1] for p in zero.iterdir() if p.name.endswith("." + suffix))


def _states(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("*.pt"))


def load_converted(path: Path, mmap: bool = False):
    """A file ds_to_universal wrote: tensors and plain data, and in optimizer_state.pt DeepSpeed's loss scaler
    and ZeRO stage enum (allowed by name; nothing else unpickles)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    with torch.serialization.safe_globals([LossScaler, DynamicLossScaler, ZeroStageEnum]):
        return torch.load(path, weights_only=True, mmap=mmap)


def _write(zero: Path, name: str, states: dict[str, object]) -> None:
    """zero/<name>/ with `states` ({file: object}), written aside and renamed into place."""
    tmp = zero / f".{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for file, value in states.items():
        torch.save(value, tmp / file)
    shutil.rmtree(zero / name, ignore_errors=True)
    tmp.rename(zero / name)


def _with_param(entry, tensor: torch.Tensor, experts: int | None):
    if not isinstance(entry, dict):  # step.pt: the optimizer step, an int
        return entry
    out = {k: v for k, v in entry.items() if k not in (IS_EXPERT, NUM_EXPERTS)}
    out["param"] = tensor
    if experts is not None:
        out.update({IS_EXPERT: True, NUM_EXPERTS: experts})
    return out


def _rename(zero: Path, rename) -> int:
    moved = 0
    for path in sorted(zero.iterdir()):
        new = rename(path.name) if path.is_dir() else path.name
        if new is None:
            shutil.rmtree(path)
        elif new != path.name:
            path.rename(zero / new)
            moved += 1
    return moved


def _param_groups(zero: Path, keep) -> None:
    path = zero / "optimizer_state.pt"
    state = load_converted(path)
    state["param_groups"] = keep(state["param_groups"])
    torch.save(state, path)


def to_hf(zero: Path, family) -> int:
    """AutoEP names -> transformers' (see the module docstring); returns the MoE blocks fused."""
    blocks = _blocks(zero, autoep.W1)
    for block in blocks:
        w = {k: zero / f"{block}.{k}" for k in (autoep.W1, autoep.W2, autoep.W3)}
        gate_up, down = {}, {}
        for file in _states(w[autoep.W1]):
            w1, w3, w2 = (load_converted(w[k] / file) for k in (autoep.W1, autoep.W3, autoep.W2))
            if not isinstance(w1, dict):
                gate_up[file] = down[file] = w1
                continue
            gate_up[file] = _with_param(w1, autoep.fuse_gate_up(w1["param"], w3["param"]), None)
            down[file] = _with_param(w2, w2["param"], None)
        _write(zero, f"{block}.{autoep.GATE_UP}", gate_up)
        _write(zero, f"{block}.{autoep.DOWN}", down)
        for path in w.values():
            shutil.rmtree(path)
    _rename(zero, lambda name: autoep.hf_name(name, blocks, family))
    _param_groups(zero, lambda groups: [g for g in groups if not g.get("moe")])
    return len(blocks)


def to_autoep(zero: Path, family, ep: int) -> int:
    """transformers' names -> AutoEP's for parallel.expert=ep; returns the MoE blocks split."""
    blocks = _blocks(zero, autoep.GATE_UP)
    for block in blocks:
        gate_up_dir, down_dir = zero / f"{block}.{autoep.GATE_UP}", zero / f"{block}.{autoep.DOWN}"
        w1s, w3s, w2s = {}, {}, {}
        for file in _states(gate_up_dir):
            gate_up, down = load_converted(gate_up_dir / file), load_converted(down_dir / file)
            if not isinstance(gate_up, dict):
                w1s[file] = w3s[file] = w2s[file] = gate_up
                continue
            w1, w3 = autoep.split_gate_up(gate_up["param"])
            experts = gate_up["param"].shape[0]
            w1s[file], w3s[file] = _with_param(gate_up, w1, experts), _with_param(gate_up, w3, experts)
            w2s[file] = _with_param(down, down["param"], experts)
        for name, states in ((autoep.W1, w1s), (autoep.W3, w3s), (autoep.W2, w2s)):
            _write(zero, f"{block}.{name}", states)
        shutil.rmtree(gate_up_dir)
        shutil.rmtree(down_dir)
    _rename(zero, lambda name: autoep.autoep_name(name, blocks, family))
    for block in blocks:  # AutoEP's alias of the router, as ds_to_universal writes it (fp32 only)
        router = zero / f"{block}.router.gate.weight"
        if (router / "fp32.pt").is_file():
            alias = {"fp32.pt": {"param": load_converted(router / "fp32.pt")["param"]}}
            _write(zero, f"{block}.{family.router}.gate.weight", alias)
    # DeepSpeed appends the expert groups after the dense ones, cut at 178,956,971 elements each (moe/utils.py
    # split_params_into_different_moe_groups_for_optimizer): at most one per expert tensor; spare ones are ignored
    copies = max(1, 3 * len(blocks))
    _param_groups(zero, lambda groups: [g for g in groups if not g.get("moe")]
                  + [{**g, "name": f"ep_size_{ep}", "moe": True} for g in groups if not g.get("moe")] * copies)
    return len(blocks)


def layout_for(ep: int) -> str:
    return AUTOEP if ep > 1 else HF


def rewrite(out: Path, marker: dict, family, ep: int) -> tuple[str, str, int]:
    """The universal folder `out` into the layout of a launch on parallel.expert=ep; returns (was, now, blocks)."""
    was, want = form(marker), layout_for(ep)
    if was == want:
        return was, want, 0
    zero = out / "zero"
    blocks = to_autoep(zero, family, ep) if want == AUTOEP else to_hf(zero, family)
    return was, want, blocks


def source_form(zero: Path) -> str:
    """The layout ds_to_universal wrote (the saving run's): AutoEP when its expert tensors are there."""
    return AUTOEP if _blocks(zero, autoep.W1) else HF
