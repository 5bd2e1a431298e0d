"""Pipeline and 3D checkpoints -> lazy HF-named tensors, one source per tensor-parallel rank.

DeepSpeed writes a pipeline's weights per layer: global_stepN/layer_XX-model_states.pt, and with tensor
parallelism one file per model-parallel rank, layer_XX-model_YY-model_states.pt (the module weights, in the
training dtype). The manifest's "partition" maps each layer's state-dict keys to the HF parameter names
(harness/model/parallel/pipeline.py hf_names), so export renames; for 3D, export.py merges the tensor ranks
tensor by tensor (tensor.merge_tensor). A tied LM head has no file of its own (it is the embedding's weight).
Files are memory-mapped (ckpt_tensors.MappedFiles): a tensor is read when it is written out.
"""

from __future__ import annotations

from harness.errors import UsageError
from harness.checkpoint.export.ckpt_tensors import Lazy, MappedFiles, lazy


def _layer_files(tag_dir, index: int) -> list:
    """A layer's files in model-parallel rank order (DeepSpeed's own naming and sort)."""
    return sorted(tag_dir.glob(f"layer_{index:02d}-*model_states.pt"))


def hf_name(names: dict[str, str], key: str) -> str:
    """A pipe layer's key -> HF name. Keys the layout does not list (3D's tensor-parallel LoRA is added to a stage
    after the layout is recorded) take the prefix of a listed sibling: layer.X -> model.layers.3.X."""
    if key in names:
        return names[key]
    for known, name in names.items():
        head = known.split(".", 1)[0] + "."
        if key.startswith(head) and name.endswith(known[len(head):]):
            return name[: len(name) - len(known) + len(head)] + key[len(head):]
    raise KeyError(f"pipe layer key {key!r} has no HF name in the checkpoint's partition")


def sources(files: MappedFiles, ref, manifest: dict) -> list[dict[str, Lazy]]:
    """[tp rank] -> {hf name: Lazy}."""
    layout = manifest.get("partition")
    if not layout:
        raise UsageError(f"{ref.tag_dir}: a pipeline checkpoint without its partition in manifest.json (written "
                         "by an older harness)\n    fix: export a checkpoint saved by this version")
    tp = int(manifest.get("tp", 1))
    out: list[dict[str, Lazy]] = [{} for _ in range(tp)]
    for layer in layout["layers"]:
        paths = _layer_files(ref.tag_dir, layer["index"])
        if not paths:
            if layer["tied"]:
                continue  # the tied head: its weight is the first stage's embedding
            raise UsageError(f"{ref.tag_dir}: no weights for pipeline layer {layer['index']} ({layer['type']})")
        if len(paths) != tp:
            raise UsageError(f"{ref.tag_dir}: layer {layer['index']} has {len(paths)} files for tp={tp}")
        for rank, path in enumerate(paths):
            for key, tensor in files[path].items():
                out[rank][hf_name(layer["hf_names"], key)] = lazy(files, tensor.shape, lambda p=path, k=key: files[p][k])
    return out
