"""The model a run trains, per layout, before the engine: loaded by share (pipeline, tp, 3d) or whole.

build(spec) -> Built: the module deepspeed.initialize gets, the tensor-parallel unit (tp) and the ModelInfo
callers keep instead of the HF model. Pipeline and 3D stages are built in harness/train/parallel/pipe_engine.py
(the PipelineModule chooses the partition); this module builds the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from harness import model_shapes
from harness.train import adapters
from harness.train.load import meta, share, source as sources


@dataclass
class Built:
    module: object  # what deepspeed.initialize gets: the HF model, its TP shard, or the PipelineModule stage
    info: meta.ModelInfo
    mpu: object = None  # tensor.TensorDataMPU for tp


def open_source(name: str, seed: int):
    """The tensors a build by share reads: a folder's (or cached hub snapshot's) safetensors, or a preset's
    seeded weights (built whole once, on CPU in fp32: the same values a one-process run starts from)."""
    from harness.train.models import build_model

    if model_shapes.is_preset(name):
        return sources.StateDictSource(build_model(name, seed=seed).state_dict(), name)
    return sources.CheckpointFiles(name if Path(name).is_dir() else _hub_snapshot(name))


def _hub_snapshot(name: str) -> str:
    from huggingface_hub import snapshot_download

    from harness.train.models import _hub_error

    try:
        return snapshot_download(name, allow_patterns=["*.json", "*.safetensors"])
    except Exception as err:  # offline without a cached copy, unknown id, no network
        raise _hub_error("model", name, err) from None


def open_model(spec):
    """(the whole model on meta, its checked source, its ModelInfo): steps 1 and the key check."""
    from harness.train.models import load_model_config

    train = spec.recipe["train"]
    model = meta.build_on_meta(load_model_config(train["model"]))
    source = open_source(train["model"], train["seed"])
    sources.check_keys(source, model)
    info = meta.ModelInfo(config=model.config, num_params=meta.num_params(model), checkpoint_dtype=source.dtype(),
                          train_dtype=meta.dtype_name(meta.train_dtype(spec.recipe["precision"])))
    return model, source, info


def build_tp(spec) -> Built:
    """Tensor parallel: meta model -> split on meta -> this rank's slices read and cast -> the shard."""
    from harness.train.models import enable_activation_checkpointing
    from harness.train.parallel.tensor import TensorDataMPU, shard_model

    model, source, info = open_model(spec)
    mpu = TensorDataMPU(spec.tp)
    shard_model(model, mpu.tp_group, mpu.tp_rank, spec.tp)
    share.materialise(model, share.hf_paths(model), source, meta.train_dtype(spec.recipe["precision"]),
                      mpu.tp_rank, spec.tp)
    check_materialised(model)
    if spec.recipe["activation_checkpointing"]:
        enable_activation_checkpointing(model)
    return Built(model, info, mpu)  # the model object now holds this rank's shard only


def build_zero3(spec) -> Built:
    """ZeRO-3 from a safetensors folder or hub snapshot: the key check on meta, then partitioned at
    construction and filled module by module (zero3.py), so a rank holds its 1/N share plus one module."""
    from harness.train.load import zero3
    from harness.train.models import enable_activation_checkpointing

    checked, source, info = open_model(spec)
    config = checked.config
    del checked  # the meta model served the key check; zero.Init builds the real one
    with zero3.large_tensors_mapped():
        model = zero3.construct(config, meta.train_dtype(spec.recipe["precision"]), spec.ds_config)
        zero3.fill(model, source)
    if spec.recipe["activation_checkpointing"]:
        enable_activation_checkpointing(model)
    return Built(model, info)


def zero3_by_module(spec) -> bool:
    """ZeRO-3 of a checkpoint with safetensors (a .bin-only folder keeps from_pretrained)."""
    name = spec.recipe["train"]["model"]
    if spec.zero_stage != 3 or model_shapes.is_preset(name):
        return False
    folder = Path(name)
    return not folder.is_dir() or (folder / sources.INDEX).is_file() or (folder / sources.SINGLE).is_file()


def build_whole(spec) -> Built:
    """Data parallel and ZeRO-1/2: transformers' from_pretrained in the training dtype; ZeRO-3 of a preset or
    a .bin folder under zero.Init too (a .bin folder then reads whole files per rank). Presets are initialised in
    fp32 from the seed and cast by the engine, as a one-process run is."""
    from harness.train.models import build_model

    train = spec.recipe["train"]
    preset = model_shapes.is_preset(train["model"])
    dtype = None if preset else meta.train_dtype(spec.recipe["precision"])
    model = build_model(train["model"], seed=train["seed"], dtype=dtype,
                        zero3_init_config=spec.ds_config if spec.zero_stage == 3 else None,
                        gradient_checkpointing=spec.recipe["activation_checkpointing"],
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


def check_materialised(module) -> None:
    left = meta.left_on_meta(module)
    if left:
        raise RuntimeError(f"left on the meta device after loading by share: {', '.join(left[:5])}")


def build(spec) -> Built:
    if spec.pp > 1:
        from harness.train.parallel import pipe_engine

        return pipe_engine.build_stage(spec)
    if spec.tp > 1:
        return build_tp(spec)
    return build_zero3(spec) if zero3_by_module(spec) else build_whole(spec)
