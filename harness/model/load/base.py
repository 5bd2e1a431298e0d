"""Steps 1 and 2 of every build by share: the whole HF model on meta, the tensors it will read (a safetensors folder,
a cached hub snapshot or a preset's seeded weights), the key check between them, and what a build returns (Built).
model/build.py (tp, ZeRO-3) and model/parallel/pipe_engine.py (pipeline and 3D stages) both start here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from harness import model_shapes
from harness.model.load import experts, meta, source as sources
from harness.model.load.renamed import renamed_view


@dataclass(frozen=True)
class Built:
    module: object  # what deepspeed.initialize gets: the HF model, its TP shard, or the PipelineModule stage
    info: meta.ModelInfo
    mpu: object = None  # tensor.TensorDataMPU for tp
    notes: tuple[str, ...] = field(default=())  # for the run's log: how it was loaded (ZeRO-3 by module), LoRA


def open_source(name: str, seed: int):
    """The tensors a build by share reads: a folder's (or cached hub snapshot's) safetensors, or a preset's
    seeded weights (built whole once, on CPU in fp32: the same values a one-process run starts from)."""
    from harness.model.hf import build_model

    if model_shapes.is_preset(name):
        return sources.StateDictSource(build_model(name, seed=seed).state_dict(), name)
    return sources.CheckpointFiles(name if Path(name).is_dir() else _hub_snapshot(name))


def _hub_snapshot(name: str) -> str:
    from huggingface_hub import snapshot_download

    from harness.model.hf import _hub_error

    try:
        return snapshot_download(name, allow_patterns=["*.json", "*.safetensors"])
    except Exception as err:  # offline without a cached copy, unknown id, no network
        raise _hub_error("model", name, err) from None


def open_model(spec):
    """(the whole model on meta, its checked source, its ModelInfo): steps 1 and the key check."""
    from harness.model.hf import load_model_config

    train = spec.recipe["train"]
    model = meta.build_on_meta(load_model_config(train["model"]))
    source = experts.fused_view(open_source(train["model"], train["seed"]), model.config)  # MoE: per-expert keys
    source = renamed_view(source, model)  # keys transformers renames at load (vision-language folders)
    sources.check_keys(source, model)
    info = meta.ModelInfo(config=model.config, num_params=meta.num_params(model), checkpoint_dtype=source.dtype(),
                          train_dtype=meta.dtype_name(meta.train_dtype(spec.recipe["precision"])))
    return model, source, info


def check_materialised(module) -> None:
    left = meta.left_on_meta(module)
    if left:
        raise RuntimeError(f"left on the meta device after loading by share: {', '.join(left[:5])}")
