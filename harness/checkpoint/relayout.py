"""Resume on another tensor / pipeline layout: what DeepSpeed's universal checkpoint needs from the harness.

ds_to_universal (resume.py runs it once, on rank 0) joins each parameter's ZeRO fragments over data-parallel
ranks, tensor ranks and pipeline stages into one whole fp32 tensor with its Adam moments and step
(universal/global_stepN/zero/NAME/{fp32,exp_avg,exp_avg_sq,step}.pt); an engine with checkpoint.load_universal
then takes its own part of each: its tensor rank's slice (along the file's cat_dim) and its ZeRO partition.
Two things DeepSpeed cannot know, the harness supplies:
  slicing  how the harness's tensor-parallel layers split (parallel/tensor.py's COLUMN/ROW table), declared as
           patterns in the model states' universal_checkpoint_info at every save (tp_patterns), so the merge
           joins row-parallel weights along dim 1 and takes replicated ones (norms, embeddings, head) whole; after
           the merge every file's cat_dim is set from the same table (set_cat_dims), so a checkpoint saved
           without tensor parallelism re-slices correctly on a tensor-parallel launch.
  names    a pipeline names parameters by layer index ("3.layer.self_attn.q_proj.weight", "tied_modules.embed.
           weight"), other layouts by the HF name. The universal folder is kept under HF names (to_hf_names,
           through the manifest's partition); a pipeline engine reads it under those names while it loads
           (hf_names_while_loading).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path

PATTERNS_VERSION = 1  # manifest "universal_patterns": its model states declare the tensor-parallel slicing
FORM_VERSION = 1  # converted.json "relayout": the folder is in the form above (an older conversion is redone)
CONVERSIONS = "conversions.jsonl"  # in the run folder: one line per conversion a launch made


def tp_patterns(module) -> dict:
    """universal_checkpoint_info entries for a model the harness can split by tensor (one with a row-parallel
    projection); {} for others (ds_to_universal's strict mode refuses patterns that match no parameter)."""
    from deepspeed.checkpoint.constants import (PARAMETER_WITH_ROW_PARALLELISM_PATTERNS,
                                                TP_REPLICATED_PARAMETER_PATTERNS)

    from harness.model.parallel.tensor import universal_patterns

    replicated, row = universal_patterns()
    if not any(re.match(row, name) for name, _ in module.named_parameters()):
        return {}
    return {TP_REPLICATED_PARAMETER_PATTERNS: [replicated], PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: [row]}


def hf_name(name: str, partition: dict | None) -> str:
    """An engine's parameter name -> the HF name (the same unless the engine is a pipeline)."""
    if not partition:
        return name
    from harness.checkpoint.export.pipeline import hf_name as layer_hf_name

    head, rest = name.split(".", 1)
    if head == "tied_modules":  # tied_modules.KEY.<attr path>: the first layer holding that tied key
        key, rest = rest.split(".", 1)
        layer = next(layer for layer in partition["layers"] if layer["tied"] == key)
    else:
        layer = partition["layers"][int(head)]
    return layer_hf_name(layer["hf_names"], rest)


def to_hf_names(zero_dir: Path, manifest: dict) -> None:
    """Rename a converted pipeline checkpoint's parameter folders to HF names (a no-op for other layouts)."""
    partition = manifest.get("partition")
    if not partition:
        return
    for folder in [p for p in zero_dir.iterdir() if p.is_dir()]:
        target = zero_dir / hf_name(folder.name, partition)
        if target != folder:
            folder.rename(target)


def set_cat_dims(zero_dir: Path) -> None:
    """Mark row-parallel parameters (parallel/tensor.py) with cat_dim 1, the dimension a tensor-parallel launch cuts
    them along: ds_to_universal writes 0 (column-parallel) for every parameter no declared pattern names, as for a
    checkpoint saved without the patterns; whole parameters are taken whole by the loader (same shape)."""
    import torch
    from deepspeed.checkpoint.constants import CAT_DIM

    from harness.checkpoint.expert_layout import load_converted
    from harness.model.parallel.tensor import split_dim

    for folder in [p for p in zero_dir.iterdir() if p.is_dir() and split_dim(p.name) == 1]:
        for path in folder.glob("*.pt"):
            state = load_converted(path)
            if isinstance(state, dict) and state.get(CAT_DIM, 1) != 1:
                torch.save({**state, CAT_DIM: 1}, path)


def both_stage_names(folder: Path) -> None:
    """The converted folder's model-states files (the client state, the step) under the names both kinds of engine
    look for: mp_rank_XX_model_states.pt (ZeRO-1/2, DeepSpeed's bf16 optimizer) and zero_pp_rank_0_mp_rank_XX_
    model_states.pt (ZeRO-3); ds_to_universal writes the saving stage's only. Hard links: no copy."""
    found = [*folder.glob("mp_rank_*_model_states.pt"), *folder.glob("zero_pp_rank_0_mp_rank_*_model_states.pt")]
    for path in found:
        mp = re.search(r"mp_rank_(\d+)_model_states", path.name).group(1)
        for name in (f"mp_rank_{mp}_model_states.pt", f"zero_pp_rank_0_mp_rank_{mp}_model_states.pt"):
            if not (folder / name).exists():
                os.link(path, folder / name)


def for_every_stage(folder: Path) -> None:
    """The converted folder as both kinds of ZeRO engine read it (ds_to_universal writes the saving stage's form):
    ZeRO-1/2 want per-parameter {param: whole tensor, cat_dim} dicts with a step.pt, and the DeepSpeed version and
    gradient clipping in zero/optimizer_state.pt; ZeRO-3 wants the Adam step and param groups under its
    optimizer_state_dict. A ZeRO-3 save gives flat tensors: shaped here from the saved param_shapes."""
    import torch
    from deepspeed.checkpoint.constants import CAT_DIM, OPTIMIZER_STATE_DICT, PARAM

    from harness.checkpoint.expert_layout import load_converted
    from harness.model.parallel.tensor import split_dim

    both_stage_names(folder)
    path = folder / "zero" / "optimizer_state.pt"
    state = load_converted(path)
    model_states = load_converted(folder / "mp_rank_00_model_states.pt", mmap=True)
    if OPTIMIZER_STATE_DICT in state:  # a ZeRO-3 save: flat tensors, the step in the global state only
        step = state[OPTIMIZER_STATE_DICT]["state"][0]["step"]
        shapes = {name: tuple(shape) for group in model_states["param_shapes"] for name, shape in group.items()}
        for param in [p for p in (folder / "zero").iterdir() if p.is_dir()]:
            for file in param.glob("*.pt"):
                tensor = load_converted(file)
                if isinstance(tensor, torch.Tensor):  # (AutoEP's gathered experts come as dicts already)
                    torch.save({PARAM: tensor.view(shapes[param.name]), CAT_DIM: split_dim(param.name) or 0}, file)
            if not (param / "step.pt").exists():
                torch.save(step, param / "step.pt")
    else:
        step = load_converted(next((folder / "zero").glob("*/step.pt")))
    state.setdefault("ds_version", model_states["ds_version"])
    state.setdefault("clip_grad", float(model_states["ds_config"].get("gradient_clipping", 0.0)))
    state.setdefault(OPTIMIZER_STATE_DICT, {"state": {0: {"step": step}}, "param_groups": state["param_groups"]})
    torch.save(state, path)


@contextlib.contextmanager
def hf_names_while_loading(engine, partition: dict | None):
    """A pipeline engine's optimizer reads the universal folder by its own parameter names: HF names while it
    loads, its own again after (its next save records them)."""
    optimizer = getattr(engine, "optimizer", None)
    names = getattr(optimizer, "param_names", None)
    if not partition or not isinstance(names, dict):
        yield
        return
    optimizer.param_names = {param: hf_name(name, partition) for param, name in names.items()}
    try:
        yield
    finally:
        optimizer.param_names = names


def layout(manifest: dict) -> dict:
    keys = ("world_size", "dp", "tp", "pp", "sp", "ep", "zero_stage")
    return {k: manifest.get(k, 1 if k in ("tp", "pp", "sp", "ep") else None) for k in keys}


def record(run_dir: Path, point, here: dict, measured: dict) -> dict:
    """One conversion, appended to RUN/conversions.jsonl: from which layout to which, its time and memory."""
    line = {"tag": point.tag, "source": str(point.folder), "from": layout(point.manifest), "to": here, **measured}
    with open(run_dir / CONVERSIONS, "a") as f:
        f.write(json.dumps(line) + "\n")
    return line
