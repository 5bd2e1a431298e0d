"""DeepSpeed checkpoint -> Hugging Face model folder (safetensors + config + tokenizer).

ZeRO-1/2/3 checkpoints are consolidated with DeepSpeed's zero_to_fp32 (fp32 master weights); a ZeRO-0
checkpoint holds whole weights in its model-states file. A tensor-parallel checkpoint is read one tensor rank
at a time the same way, and the ranks' weights are merged by parallel.tensor.merge_shards; pipeline and 3D
checkpoints hold per-layer files (parallel/pipe_export.py). Every checkpoint the harness writes carries
probe.pt (the engine's logits on a fixed batch), so an export is verified against the trained engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from harness.errors import UsageError

PROBE = "probe.pt"
TOLERANCE = {"fp32": 1e-4, "bf16": 0.25, "fp16": 0.05}  # max |logit diff| vs the engine, by training precision


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


def _rank_state_dict(ref: CheckpointRef, zero_stage: int, mp_rank: int) -> dict:
    """fp32 weights of one tensor-parallel rank: ZeRO-1/2/3 through zero_to_fp32 (the fp32 master) over a view
    of the tag folder holding only that rank's files (zero_to_fp32 expects one model-parallel rank); ZeRO-0 from
    its mp_rank_XX model-states file."""
    import os
    import tempfile

    import torch

    if zero_stage == 0:
        states = torch.load(ref.tag_dir / f"mp_rank_{mp_rank:02d}_model_states.pt", map_location="cpu",
                            weights_only=True)
        return {k: v.float() for k, v in states["module"].items()}
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with tempfile.TemporaryDirectory() as view:
        (Path(view) / ref.tag).mkdir()
        for f in ref.tag_dir.glob(f"*mp_rank_{mp_rank:02d}_*"):
            os.symlink(f, Path(view) / ref.tag / f.name)
        return get_fp32_state_dict_from_zero_checkpoint(view, tag=ref.tag)


def fp32_state_dict(ref: CheckpointRef, manifest: dict) -> dict:
    """Whole fp32 weights; a tensor-parallel checkpoint's ranks are merged by parallel.tensor.merge_shards."""
    if manifest.get("pp", 1) > 1:  # per-layer files (pipeline, 3D)
        from harness.train.parallel import pipe_export

        return pipe_export.state_dict(ref, manifest)
    zero_stage, tp = manifest["zero_stage"], manifest.get("tp", 1)
    if tp == 1 and zero_stage >= 1:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return get_fp32_state_dict_from_zero_checkpoint(str(ref.ckpt_dir), tag=ref.tag)
    if tp == 1:
        return _rank_state_dict(ref, zero_stage, 0)
    from transformers import AutoConfig

    from harness.train.parallel.tensor import merge_shards

    shards = [_rank_state_dict(ref, zero_stage, r) for r in range(tp)]
    return merge_shards(shards, AutoConfig.from_pretrained(ref.ckpt_dir / "hf"))


def build_hf_model(ref: CheckpointRef, state: dict):
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = ref.ckpt_dir / "hf"
    if not (hf / "config.json").is_file():
        raise UsageError(f"{hf}: no config.json; this checkpoint folder was not written by harness/run.py")
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(hf))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {k for k in missing if k.endswith("lm_head.weight") and model.config.tie_word_embeddings}
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"checkpoint does not match the model: missing {sorted(set(missing) - tied)[:5]}, "
                           f"unexpected {sorted(unexpected)[:5]}")
    model.tie_weights()
    return model.float().eval()


def verify(ref: CheckpointRef, model) -> float | None:
    """Max |logit difference| between the exported model and the engine on the saved probe batch."""
    import torch

    probe = ref.tag_dir / PROBE
    if not probe.is_file():
        return None
    saved = torch.load(probe, map_location="cpu", weights_only=True)
    with torch.no_grad():
        logits = model(input_ids=saved["input_ids"]).logits.float()
    return float((logits - saved["logits"].float()).abs().max())


def export(ckpt: str | Path, out: str | Path, overwrite: bool = False, adapter_only: bool = False) -> dict:
    from transformers import AutoTokenizer

    out = Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise UsageError(f"{out} is not empty\n    fix: choose a new --out folder, or pass --overwrite")
    ref = find_checkpoint(ckpt)
    manifest = ref.manifest()
    if adapter_only or manifest.get("adapter", {}).get("type") == "lora":  # the checkpoint holds adapters only
        from harness.train import export_lora

        info = export_lora.export(ref, manifest, out, adapter_only)
        return {"checkpoint": str(ref.tag_dir), "out": str(out), "step": manifest.get("step"),
                "zero_stage": manifest["zero_stage"], "tp": manifest.get("tp", 1), "adapter_only": adapter_only,
                "tolerance": TOLERANCE.get(manifest.get("precision", "fp32"), 1e-4), **info}
    model = build_hf_model(ref, fp32_state_dict(ref, manifest))
    diff = verify(ref, model)
    limit = TOLERANCE.get(manifest.get("precision", "fp32"), 1e-4)
    if diff is not None and diff > limit:
        raise RuntimeError(f"exported model disagrees with the engine: max |logit diff| {diff:.3g} > {limit} "
                           f"({manifest.get('precision')} training); not writing {out}")
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(ref.ckpt_dir / "hf").save_pretrained(out)
    return {"checkpoint": str(ref.tag_dir), "out": str(out), "step": manifest.get("step"),
            "zero_stage": manifest["zero_stage"], "tp": manifest.get("tp", 1), "max_logit_diff": diff,
            "tolerance": limit}
