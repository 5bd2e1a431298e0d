"""DeepSpeed checkpoint -> Hugging Face model folder, streamed: one output shard in memory at a time.

`export` writes what save_pretrained writes (sharded safetensors + model.safetensors.index.json, or one
model.safetensors; config.json, generation_config.json, tokenizer files) without ever holding the model: the
output's names, shapes and dtypes come from the model built on the meta device, the shard plan from those
alone (hf_shards.plan_shards), and each tensor is read from the rank files only when its shard is filled
(ckpt_tensors: ZeRO-0/1/2/3 partitions per tensor rank; export/pipeline.py: pipeline and 3D per-layer
files; tensor-parallel pieces merged tensor by tensor with parallel.tensor.merge_tensor). Peak private memory
is about one output shard plus the largest tensor. Every checkpoint the harness writes carries probe.pt (the
engine's logits on a fixed batch); the written folder is loaded (memory-mapped: transformers reads a
safetensors file in its own dtype without copying it) and its logits are checked against the engine's.

The streaming pieces, for other exports (LoRA adapters, merged models) to reuse or wrap:
    files = MappedFiles(shard_bytes)                        # ckpt_tensors: mapped rank files, dropped as read
    state = open_state(ref, manifest, files)                # state.py: {hf name: Lazy(shape, read)}; reads nothing
    model = meta_model(ref); names = save_names(model)      # what save_pretrained would write, in its order
    check_keys(state, names, model, ref.tag_dir)            # missing / unexpected / wrong shape: UsageError
    split = plan_shards(specs(state, names, dtype, model), "5GB")       # hf_shards: shapes and dtypes only
    write_sharded(out, split, iter_state(state, names, dtype), model.num_parameters())
iter_state yields (name, tensor) one at a time; any generator of such pairs (a merged LoRA weight computed
from its base tensor and factors, say) can stand in for it, with plan_shards given the same names.
"""

from __future__ import annotations

import math
import shutil
import time
from pathlib import Path
from typing import Iterator

from harness.checkpoint.export.state import (IMAGE_PROCESSOR, PROBE, TOLERANCE, CheckpointRef, find_checkpoint,
                                             open_state, train_dtype)
from harness.config.defaults import PRECISION_DTYPES
from harness.errors import UsageError

DEFAULT_SHARD_SIZE = "5GB"  # save_pretrained's default in transformers 5


def meta_model(ref: CheckpointRef):
    """The checkpoint's HF model on the meta device: names, shapes, tied weights; no memory."""
    import torch
    from transformers import AutoConfig

    from harness.model.hf import auto_class

    hf = ref.ckpt_dir / "hf"
    if not (hf / "config.json").is_file():
        raise UsageError(f"{hf}: no config.json; this checkpoint folder was not written by harness/run.py")
    config = AutoConfig.from_pretrained(hf)
    with torch.device("meta"):
        return auto_class(config).from_config(config)  # a vision-language model: AutoModelForImageTextToText


def save_names(model) -> list[str]:
    """The tensors save_pretrained writes, in its order: the state dict less tied copies and ignored keys."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    state = model.state_dict()
    for key in model._keys_to_ignore_on_save or ():
        state.pop(key, None)
    return list(remove_tied_weights_from_state_dict(state, model))


def check_keys(state: dict, names: list[str], model, where: Path) -> None:
    """Every tensor to write is in the checkpoint with the model's shape; nothing in it is unknown to the model."""
    expected = model.state_dict()
    missing = [n for n in names if n not in state]
    unexpected = [n for n in state if n not in expected]
    wrong = [f"{n} {tuple(state[n].shape)} vs {tuple(expected[n].shape)}" for n in names
             if n in state and tuple(state[n].shape) != tuple(expected[n].shape)]
    if missing or unexpected or wrong:
        raise UsageError(f"{where}: checkpoint does not match the model config in {where.parent / 'hf'}: "
                         f"missing {missing[:5]}, unexpected {unexpected[:5]}, shape {wrong[:5]}\n"
                         "    fix: export a checkpoint written by this harness with its own hf/ folder")


def _out_dtype(tensor_dtype, dtype):
    return dtype if dtype is not None and tensor_dtype.is_floating_point else tensor_dtype


def specs(state: dict, names: list[str], dtype, model) -> list[tuple]:
    """(name, shape, output dtype) for the shard plan; a tensor's stored dtype is the model's for ints."""
    expected = model.state_dict()
    return [(n, tuple(state[n].shape), _out_dtype(expected[n].dtype, dtype)) for n in names]


def iter_state(state: dict, names: list[str], dtype=None) -> Iterator[tuple]:
    """(name, tensor) in `names` order, each read when asked for and cast to `dtype` (floating tensors)."""
    for name in names:
        entry = state[name]
        if entry.read_as is not None and dtype is not None:
            yield name, entry.read_as(dtype)
            continue
        tensor = entry.read()
        yield name, tensor.to(_out_dtype(tensor.dtype, dtype))


def verify(ref: CheckpointRef, folder: Path, dtype) -> float | None:
    """Max |logit difference| between the written folder and the engine on the saved probe batch. Loaded in
    the files' dtype, so transformers maps the safetensors files instead of copying them."""
    import torch
    from transformers import AutoConfig

    from harness.model.hf import auto_class

    probe = ref.tag_dir / PROBE
    if not probe.is_file():
        return None
    saved = torch.load(probe, map_location="cpu", weights_only=True)
    model = auto_class(AutoConfig.from_pretrained(folder)).from_pretrained(folder, dtype=dtype).eval()
    with torch.no_grad():
        logits = model(input_ids=saved["input_ids"]).logits.float()
    return float((logits - saved["logits"].float()).abs().max())


def _write_folder(ref: CheckpointRef, manifest: dict, folder: Path, dtype, max_shard_size) -> dict:
    """Weights, config, generation config and tokenizer into `folder`; returns the sizes written."""
    from transformers import AutoTokenizer

    from harness.checkpoint.export.ckpt_tensors import FILE_BUDGET_BYTES, MappedFiles
    from harness.checkpoint.export.hf_shards import parse_shard_size, plan_shards, write_sharded

    model = meta_model(ref)
    # maps dropped after each shard's worth of reading: the checkpoint pages touched stay about a shard too
    files = MappedFiles(min(FILE_BUDGET_BYTES, parse_shard_size(max_shard_size)))
    state, names = open_state(ref, manifest, files), save_names(model)
    if is_lora(manifest):  # the checkpoint holds the adapters only: the base streamed through W + s B A
        from harness.checkpoint.export import lora as export_lora

        state = export_lora.merged_lazy(manifest, state, model)
    check_keys(state, names, model, ref.tag_dir)
    plan = specs(state, names, dtype, model)
    split = plan_shards(plan, max_shard_size)
    shards = write_sharded(folder, split, iter_state(state, names, dtype), model.num_parameters())
    model.config.dtype = str(dtype).removeprefix("torch.")  # as save_pretrained records it
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(folder)
    if model.can_generate():
        model.generation_config.save_pretrained(folder)
    AutoTokenizer.from_pretrained(ref.ckpt_dir / "hf").save_pretrained(folder)
    if (ref.ckpt_dir / "hf" / IMAGE_PROCESSOR).is_file():  # a vision-language model's image processor
        shutil.copy(ref.ckpt_dir / "hf" / IMAGE_PROCESSOR, folder / IMAGE_PROCESSOR)
    return {"shards": len(shards), "total_size_bytes": split.metadata["total_size"],
            "largest_tensor_bytes": max(math.prod(s) * d.itemsize for _, s, d in plan)}


def _move_into(staging: Path, out: Path) -> None:
    """Staged files into `out`; earlier weight files there (another shard count) go, as save_pretrained does."""
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("model*.safetensors"), *out.glob("model.safetensors.index.json")]:
        old.unlink()
    for path in staging.iterdir():
        path.replace(out / path.name)


def is_lora(manifest: dict) -> bool:
    return manifest.get("adapter", {}).get("type") == "lora"


def export(ckpt: str | Path, out: str | Path, overwrite: bool = False, max_shard_size: str | int = DEFAULT_SHARD_SIZE,
           dtype: str | None = None, adapter_only: bool = False) -> dict:
    import torch

    from harness.checkpoint.export.hf_shards import parse_shard_size

    out = Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise UsageError(f"{out} is not empty\n    fix: choose a new --out folder, or pass --overwrite")
    parse_shard_size(max_shard_size)
    ref = find_checkpoint(ckpt)
    manifest = ref.manifest()
    trained = train_dtype(manifest)
    name = dtype or trained
    if name not in PRECISION_DTYPES:
        raise UsageError(f"--dtype {name!r}: not one of {', '.join(PRECISION_DTYPES)}")
    torch_dtype = getattr(torch, PRECISION_DTYPES[name])
    start = time.perf_counter()
    if adapter_only:  # a peft adapter folder: the adapters alone (LoRA runs)
        from harness.checkpoint.export import lora as export_lora

        info = export_lora.export_adapter(ref, manifest, out, torch_dtype)
        return {"checkpoint": str(ref.tag_dir), "out": str(out), "step": manifest.get("step"),
                "zero_stage": manifest["zero_stage"], "tp": manifest.get("tp", 1), "pp": manifest.get("pp", 1),
                "dtype": name, "tolerance": TOLERANCE[trained], "seconds": time.perf_counter() - start,
                "adapter_only": True, **info}
    staging = out.parent / f".{out.name}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        sizes = _write_folder(ref, manifest, staging, torch_dtype, max_shard_size)
        diff = verify(ref, staging, torch_dtype)
        limit = max(TOLERANCE[trained], TOLERANCE[name])
        if diff is not None and diff > limit:
            raise UsageError(f"{ref.tag_dir}: the exported model disagrees with the engine: max |logit diff| "
                             f"{diff:.3g} > tolerance {limit} ({trained} training, {name} export); not writing "
                             f"{out}\n    fix: export in the training dtype (--dtype {trained}); if that fails too, "
                             "the saved weights are not the ones the engine trained (check the manifest's dtypes)")
        _move_into(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return {"checkpoint": str(ref.tag_dir), "out": str(out), "step": manifest.get("step"),
            "zero_stage": manifest["zero_stage"], "tp": manifest.get("tp", 1), "pp": manifest.get("pp", 1),
            "dtype": name, "max_logit_diff": diff, "tolerance": limit, "seconds": time.perf_counter() - start,
            "vision": (out / IMAGE_PROCESSOR).is_file(), **sizes}
