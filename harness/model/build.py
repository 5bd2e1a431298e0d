"""The model a run trains, per layout, before the engine: loaded by share (pipeline, tp, 3d) or whole.

build(spec) -> Built: the module deepspeed.initialize gets, the tensor-parallel unit (tp) and the ModelInfo
callers keep instead of the HF model. Pipeline and 3D stages are built in harness/model/parallel/pipe_engine.py
(the PipelineModule chooses the partition); this module builds the rest.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from harness import model_shapes
from harness.config.objectives import objective_of
from harness.model import adapters
from harness.model.load import meta, source as sources
from harness.model.load.materialise import hf_paths, materialise
from harness.model.load.base import Built, check_materialised, open_model


def build_tp(spec) -> Built:
    """Tensor parallel: meta model -> split on meta -> this rank's slices read and cast -> the shard."""
    from harness.model.hf import enable_activation_checkpointing
    from harness.model.parallel.tensor import TensorDataMPU, shard_model

    model, source, info = open_model(spec)
    mpu = TensorDataMPU(spec.tp)
    shard_model(model, mpu.tp_group, mpu.tp_rank, spec.tp)
    materialise(model, hf_paths(model), source, meta.train_dtype(spec.recipe["precision"]),
                      mpu.tp_rank, spec.tp)
    check_materialised(model)
    if spec.recipe["activation_checkpointing"]:
        enable_activation_checkpointing(model)
    return Built(model, info, mpu)  # the model object now holds this rank's shard only


def build_zero3(spec) -> Built:
    """ZeRO-3 from a safetensors folder or hub snapshot: the key check on meta, then partitioned at
    construction and filled module by module (zero3.py), so a rank holds its 1/N share plus one module."""
    from harness.model.load import zero3
    from harness.model.hf import enable_activation_checkpointing

    checked, source, info = open_model(spec)
    config = checked.config
    del checked  # the meta model served the key check; zero.Init builds the real one
    with zero3.large_tensors_mapped():
        model = zero3.construct(config, meta.train_dtype(spec.recipe["precision"]), spec.ds_config)
        read = zero3.fill(model, source)
    if spec.recipe["activation_checkpointing"]:
        enable_activation_checkpointing(model)
    fused = len(getattr(source, "fused", ())) // 2
    note = (f"load: ZeRO-3 filled module by module from {source.where}: rank 0 read {read / 2**20:.2f} MiB, the "
            "other ranks nothing" + (f"; the experts of {fused} MoE blocks fused from per-expert keys "
                                     "(load/experts.py)" if fused else ""))
    return Built(model, info, notes=(note,))


def zero3_by_module(spec) -> bool:
    """ZeRO-3 of a checkpoint with safetensors (a .bin-only folder keeps from_pretrained)."""
    name = spec.recipe["train"]["model"]
    if spec.zero_stage != 3 or model_shapes.is_preset(name):
        return False
    folder = Path(name)  # MoE folders too: load/experts.py reads per-expert keys as the fused tensors
    return not folder.is_dir() or (folder / sources.INDEX).is_file() or (folder / sources.SINGLE).is_file()


def build_whole(spec) -> Built:
    """Data parallel and ZeRO-1/2: transformers' from_pretrained in the training dtype; ZeRO-3 of a preset or
    a .bin folder under zero.Init too (a .bin folder then reads whole files per rank). Presets are initialised in
    fp32 from the seed and cast by the engine, as a one-process run is."""
    from harness.model.hf import build_model

    train = spec.recipe["train"]
    preset = model_shapes.is_preset(train["model"])
    dtype = None if preset else meta.train_dtype(spec.recipe["precision"])
    model = build_model(train["model"], seed=train["seed"], dtype=dtype,
                        zero3_init_config=spec.ds_config if spec.zero_stage == 3 else None,
                        gradient_checkpointing=spec.recipe["activation_checkpointing"],
                        head="reward" if objective_of(spec.recipe).name == "reward" else "causal",
                        **adapters.build_kwargs(spec.recipe))  # QLoRA: the 4-bit base
    info = meta.ModelInfo(config=model.config, num_params=sum(getattr(p, "ds_numel", p.numel())
                                                              for p in model.parameters()),
                          checkpoint_dtype="float32" if preset else _checkpoint_dtype(train["model"]),
                          train_dtype=meta.dtype_name(meta.train_dtype(spec.recipe["precision"])))
    return Built(model, info)


def _checkpoint_dtype(name: str) -> str | None:
    try:
        return sources.CheckpointFiles(name).dtype() if Path(name).is_dir() else None
    except Exception:  # a .bin folder: from_pretrained read it; the manifest then does not name its dtype
        return None


def build(spec) -> Built:
    built = _build(spec)
    if spec.pp == 1:  # pipeline stages: pipe_engine.build_stage applies it to the HF model they are cut from
        from harness.model import attention

        attention.apply(built.module, spec)
        from harness.model import vision

        if vision.is_vision_language(built.module.config):  # every rank calls the vision tower alike; model.freeze
            note = vision.install(built.module, tuple(spec.recipe["vision"]["freeze"]))
            built = dataclasses.replace(built, notes=(*built.notes, note))
    return built


def _build(spec) -> Built:
    if spec.pp > 1:
        from harness.model.parallel import pipe_engine

        return pipe_engine.build_stage(spec)
    if spec.tp > 1:
        return build_tp(spec)
    if objective_of(spec.recipe).name == "reward":  # a sequence-classification model: transformers' own loading
        return build_whole(spec)
    return build_zero3(spec) if zero3_by_module(spec) else build_whole(spec)
