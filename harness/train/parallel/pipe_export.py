"""Pipeline and 3D checkpoints -> one HF state dict.

DeepSpeed writes a pipeline's weights per layer: global_stepN/layer_XX-model_states.pt, and with tensor
parallelism one file per model-parallel rank, layer_XX-model_YY-model_states.pt (the module weights, in the
training dtype). The manifest's "partition" maps each layer's state-dict keys to the HF parameter names
(harness/train/parallel/pipeline.py hf_names), so export renames, and for 3D merges the tensor-parallel
shards with tensor.merge_shards. A tied LM head has no file of its own (it is the embedding's weight).
"""

from __future__ import annotations

from harness.errors import UsageError


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


def state_dict(ref, manifest: dict) -> dict:
    import torch

    layout = manifest.get("partition")
    if not layout:
        raise UsageError(f"{ref.tag_dir}: a pipeline checkpoint without its partition in manifest.json (written "
                         "by an older harness)\n    fix: export a checkpoint saved by this version")
    tp = int(manifest.get("tp", 1))
    shards: list[dict] = [{} for _ in range(tp)]
    for layer in layout["layers"]:
        files = _layer_files(ref.tag_dir, layer["index"])
        if not files:
            if layer["tied"]:
                continue  # the tied head: its weight is the first stage's embedding
            raise UsageError(f"{ref.tag_dir}: no weights for pipeline layer {layer['index']} ({layer['type']})")
        if len(files) != tp:
            raise UsageError(f"{ref.tag_dir}: layer {layer['index']} has {len(files)} files for tp={tp}")
        for rank, path in enumerate(files):
            weights = torch.load(path, map_location="cpu", weights_only=True)
            for key, tensor in weights.items():
                shards[rank][hf_name(layer["hf_names"], key)] = tensor.float()
    if tp == 1:
        return shards[0]
    from transformers import AutoConfig

    from harness.train.parallel import tensor

    return tensor.merge_shards(shards, AutoConfig.from_pretrained(ref.ckpt_dir / "hf"))
