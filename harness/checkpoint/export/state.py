"""Which checkpoint an export reads, the dtype it trained in, and all its weights as lazy tensors (reads nothing).

    ref = find_checkpoint(run_or_ckpt_folder)               # the checkpoint: a run folder, checkpoints/ or a tag
    state = open_state(ref, ref.manifest(), files)          # {hf name: ckpt_tensors.Lazy}, tensor ranks merged
Shared by the model export (folder.py) and the LoRA export (lora.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from harness.config.defaults import PRECISION_DTYPES
from harness.errors import UsageError

PROBE = "probe.pt"
IMAGE_PROCESSOR = "preprocessor_config.json"  # what image_processor.save_pretrained writes (vision-language)
TOLERANCE = {"fp32": 1e-4, "bf16": 0.25, "fp16": 0.05}  # max |logit diff| vs the engine, by the coarser dtype


@dataclass(frozen=True)
class CheckpointRef:
    ckpt_dir: Path  # folder holding `latest` and global_stepN/
    tag: str

    @property
    def tag_dir(self) -> Path:
        return self.ckpt_dir / self.tag

    def manifest(self) -> dict:
        path = self.tag_dir / "manifest.json"
        if not path.is_file():
            raise UsageError(f"{self.tag_dir}: no manifest.json (an incomplete checkpoint, or not written by "
                             "dsharness)\n    fix: export a checkpoint whose save finished")
        return json.loads(path.read_text())


def find_checkpoint(path: str | Path) -> CheckpointRef:
    """Accept a run folder, its checkpoints/ folder, or one global_stepN folder."""
    path = Path(path)
    if (path / "checkpoints").is_dir():
        path = path / "checkpoints"
    if (path / "latest").is_file():
        return CheckpointRef(path, (path / "latest").read_text().strip())
    if path.is_dir() and path.name.startswith("global_step"):
        return CheckpointRef(path.parent, path.name)
    raise UsageError(f"{path}: not a checkpoint (expected a run folder, its checkpoints/ folder, or "
                     "checkpoints/global_stepN)")


def train_dtype(manifest: dict) -> str:
    """The dtype the run trained in: the manifest's train_dtype, else its precision (older manifests)."""
    name = manifest.get("train_dtype") or manifest.get("precision") or "fp32"
    short = {v: k for k, v in PRECISION_DTYPES.items()}.get(name, name)
    if short not in PRECISION_DTYPES:
        raise UsageError(f"manifest train dtype {name!r} is not one of {', '.join(PRECISION_DTYPES)}")
    return short


def open_state(ref: CheckpointRef, manifest: dict, files) -> dict:
    """Every weight of the checkpoint as {hf name: ckpt_tensors.Lazy}, tensor ranks merged; reads nothing."""
    from harness.checkpoint.export.ckpt_tensors import zero_source

    if manifest.get("pp", 1) > 1:  # per-layer files (pipeline, 3D)
        from harness.checkpoint.export import pipeline as pipe_export

        ranks = pipe_export.sources(files, ref, manifest)
    else:
        ranks = [zero_source(files, ref.tag_dir, manifest["zero_stage"], r) for r in range(manifest.get("tp", 1))]
        if manifest.get("ep", 1) > 1:  # DeepSpeed AutoEP: per-expert files fused back into transformers' tensors
            from harness.checkpoint.export import autoep

            ranks = [autoep.fused_state(files, ref.tag_dir, ranks[0], manifest["zero_stage"])]
    if len(ranks) == 1:
        return ranks[0]
    from transformers import AutoConfig

    from harness.model.parallel import tensor

    tensor.supported(AutoConfig.from_pretrained(ref.ckpt_dir / "hf"), len(ranks))
    # A name on some ranks only (a tied head recorded as shared by one rank's file) is left out: check_keys
    # then names it if the model needs it.
    common = [key for key in ranks[0] if all(key in r for r in ranks[1:])]
    return {key: _merged(key, [r[key] for r in ranks], tensor) for key in common}


def _merged(key: str, parts: list, tensor):
    from harness.checkpoint.export.ckpt_tensors import Lazy

    return Lazy(tensor.merged_shape(key, [p.shape for p in parts]),
                lambda: tensor.merge_tensor(key, [p.read() for p in parts]))
