"""Optimizers without Adam's two moments through DeepSpeed's universal conversion (plain SGD, Lion, Adagrad).

DeepSpeed 0.19.8's ds_to_universal reads `exp_avg` and `exp_avg_sq` of every parameter group of a ZeRO-1/2/3
optimizer file (extract_zero_shards / extract_zero_shards_stage3) and its ZeRO-3 loader reads both back and the
`step` of group 0 (stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3); plain SGD keeps no state at all
(KeyError 0), Lion keeps exp_avg only, Adagrad exp_avg_sq only. The state layout is the optimizer's, not the model's:
any ZeRO save with such an optimizer fails to relayout, a vision-language model or a causal LM alike.

So, before the conversion (rank 0, resume._convert), `staged` links the checkpoint's other files into a staging
folder and rewrites its optimizer files there (their fp32 partitions copied once, deleted after the conversion) with
the missing moments as zeros (a stride-0 view of one zero: a few bytes on disk, whatever the partition's size) and a
step where ZeRO-3 wants one; the conversion then runs unchanged, and `drop` takes the
injected keys out of the loaded optimizer's state right after the load (checkpoint/save.load), so the resumed
optimizer holds what a fresh one of its kind holds: nothing for plain SGD. SGD with momentum keeps a
`momentum_buffer` that neither the converter nor the ZeRO-3 loader carries, and so does DeepSpeed's Muon: session
refuses those resumes before launch (`refusal`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

MOMENTS = ("exp_avg", "exp_avg_sq")
INJECTED = "injected_moments.json"  # in the universal folder: the state keys `drop` removes after the load


def _load(path: Path) -> dict:
    """A ZeRO optimizer file, weights only: tensors, plain data and DeepSpeed's own types (ZeRO-1/2 files carry
    fragment addresses)."""
    from deepspeed.utils.tensor_fragment import fragment_address

    from harness.checkpoint.expert_layout import load_converted

    with torch.serialization.safe_globals([fragment_address]):
        return load_converted(path)


def _groups(sd: dict) -> tuple[dict, list]:
    """(state by group index, fp32 flat partitions) of a ZeRO optimizer file's optimizer_state_dict."""
    if "fp32_flat_groups" in sd:  # ZeRO-3
        return sd["optimizer_state_dict"]["state"], sd["fp32_flat_groups"]
    return sd["base_optimizer_state"]["state"], sd["single_partition_of_fp32_groups"]


def missing(source: Path) -> list[str]:
    """The state keys ds_to_universal needs that the saved optimizer lacks (none for Adam and AdamW)."""
    files = sorted(source.glob("*optim_states.pt"))
    if not files:
        return []
    sd = _load(files[0])["optimizer_state_dict"]
    state, flats = _groups(sd)
    need = [k for k in MOMENTS if any(k not in state.get(i, {}) for i in range(len(flats)))]
    if need and "step" not in state.get(0, {}):  # ZeRO-3's loader reads it; relayout.for_every_stage a step.pt
        need.append("step")
    return need


def staged(source: Path, stage_dir: Path, keys: list[str]) -> Path:
    """`source` linked into `stage_dir`, its optimizer files rewritten with `keys` filled (zeros, step 0)."""
    import shutil

    shutil.rmtree(stage_dir, ignore_errors=True)  # left by an interrupted conversion
    stage_dir.mkdir(parents=True)
    for path in source.iterdir():
        if path.is_file() and not path.name.endswith("optim_states.pt"):
            os.link(path, stage_dir / path.name)
    for path in source.glob("*optim_states.pt"):
        whole = _load(path)
        state, flats = _groups(whole["optimizer_state_dict"])
        for index, flat in enumerate(flats):
            entry = state.setdefault(index, {})
            for key in keys:
                if key == "step":
                    entry.setdefault("step", torch.tensor(0.0))
                else:
                    entry.setdefault(key, torch.zeros(1, dtype=flat.dtype).expand(flat.numel()))
        torch.save(whole, stage_dir / path.name)
    return stage_dir


def record(out: Path, keys: list[str]) -> None:
    if keys:
        (out / INJECTED).write_text(json.dumps(keys) + "\n")


def drop(engine, folder: Path) -> None:
    """Take the moments `staged` filled in out of the loaded optimizer's state (a universal load only)."""
    path = folder / INJECTED
    if not path.is_file():
        return
    keys = json.loads(path.read_text())
    optimizer = getattr(engine.optimizer, "optimizer", engine.optimizer)
    for entry in optimizer.state.values():
        for key in keys:
            entry.pop(key, None)
    for param in [p for p, entry in optimizer.state.items() if not entry]:
        del optimizer.state[param]


def refusal(ds: dict) -> str | None:
    """Why this launch's optimizer cannot resume through the universal form, or None."""
    opt = ds.get("optimizer") or {}
    momentum = float((opt.get("params") or {}).get("momentum", 0) or 0)
    if str(opt.get("type", "")).lower() == "sgd" and momentum:
        return (f"optimizer sgd with momentum {momentum:g}: its momentum_buffer is not carried by DeepSpeed 0.19.8's "
                "universal checkpoint (ds_to_universal and the ZeRO-3 loader copy only Adam's exp_avg and exp_avg_sq), "
                "so the resumed steps would start from a zero momentum and not continue the run")
    if str(opt.get("type", "")).lower() == "muon":  # measured: the Muon matrices come back with zero Adam moments
        return ("optimizer muon: DeepSpeed 0.19.8's universal checkpoint does not carry Muon's momentum_buffer "
                "(ds_to_universal writes exp_avg and exp_avg_sq for every parameter), so the resumed steps would start "
                "from a zero momentum and not continue the run")
    return None
