"""Checkpoints: DeepSpeed's own layout plus what the harness needs to resume and export.

checkpoints/
  latest, zero_to_fp32.py, global_stepN/...   DeepSpeed (save/load are collective: every rank calls)
  global_stepN/manifest.json                  world size, stage, tp, pp, precision, versions, recipe
  global_stepN/rng_rank{R}.pt                 per-rank RNG states (client_state is rank 0's only)
  hf/                                         model config + tokenizer, for `harness export`
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch

from harness.errors import UsageError
from harness.train.dist import DistInfo, barrier

MANIFEST = "manifest.json"


def tag_for(step: int) -> str:
    return f"global_step{step}"


def _rng_state() -> dict:
    """Tensors, ints, floats and strings only, so the file loads with torch.load(weights_only=True): a
    checkpoint folder may come from elsewhere, and a pickled numpy array would need full unpickling."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss))}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def manifest(spec, step: int) -> dict:
    import deepspeed
    import transformers

    return {"step": step, "world_size": spec.world_size, "zero_stage": spec.zero_stage, "tp": spec.tp,
            "pp": spec.pp, "dp": spec.dp, "precision": spec.recipe["precision"], "recipe": spec.recipe_name,
            "model": spec.recipe["train"]["model"], "deepspeed": deepspeed.__version__,
            "torch": torch.__version__, "transformers": transformers.__version__,
            **({"partition": spec.layout} if spec.layout else {})}


def save_hf_files(ckpt_dir: Path, model, tokenizer) -> None:
    """Model config + tokenizer once per run (rank 0), so export needs nothing but the checkpoint folder."""
    hf = ckpt_dir / "hf"
    if not (hf / "config.json").exists():
        hf.mkdir(parents=True, exist_ok=True)
        model.config.save_pretrained(hf)
        tokenizer.save_pretrained(hf)


@torch.no_grad()
def probe_logits(engine, probe_ids: torch.Tensor) -> torch.Tensor | None:
    """The engine's logits on a fixed batch (collective under ZeRO-3 and pipelines: every rank calls; a
    pipeline returns them on rank 0 only)."""
    from harness.train.parallel import pipe_engine

    if pipe_engine.is_pipeline(engine):
        return pipe_engine.probe_logits(engine, probe_ids)
    was_training = engine.training
    engine.eval()
    logits = engine(input_ids=probe_ids.to(engine.device), use_cache=False).logits.float().cpu()
    engine.train(was_training)
    return logits


def save(engine, spec, dist: DistInfo, ckpt_dir: Path, step: int, client_state: dict,
         probe_ids: torch.Tensor | None = None) -> Path:
    tag = tag_for(step)
    if (ckpt_dir / tag / MANIFEST).exists():
        raise RuntimeError(f"refusing to overwrite checkpoint {ckpt_dir / tag}")  # guarded earlier; invariant
    engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=client_state)
    torch.save(_rng_state(), ckpt_dir / tag / f"rng_rank{dist.rank}.pt")
    if probe_ids is not None:  # lets `harness export` verify the exported weights against this engine
        logits = probe_logits(engine, probe_ids)
        if dist.is_main:
            torch.save({"input_ids": probe_ids, "logits": logits}, ckpt_dir / tag / "probe.pt")
    barrier()
    if dist.is_main:  # the manifest marks the checkpoint complete: written last
        (ckpt_dir / tag / MANIFEST).write_text(json.dumps(manifest(spec, step), indent=2) + "\n")
    barrier()
    return ckpt_dir / tag


def resolve_resume(resume: str, run_dir: Path) -> tuple[Path, str]:
    """(checkpoint folder, tag) for --resume latest|PATH."""
    path = run_dir / "checkpoints" if resume == "latest" else Path(resume)
    if (path / "checkpoints").is_dir():
        path = path / "checkpoints"
    if (path / "latest").is_file():
        return path, (path / "latest").read_text().strip()
    return path.parent, path.name  # a global_stepN folder


def later_tags(ckpt_dir: Path, step: int) -> list[str]:
    tags = [p.name for p in ckpt_dir.glob("global_step*") if p.name[len("global_step"):].isdigit()]
    return sorted(t for t in tags if int(t[len("global_step"):]) > step)


def check_layout(spec, ckpt_dir: Path, tag: str) -> None:
    """DeepSpeed finds a checkpoint's files by this launch's layout (per pipeline layer, per tensor rank): a
    checkpoint saved with other pipeline/tensor degrees would load wrong or half."""
    path = ckpt_dir / tag / MANIFEST
    if not path.is_file():
        return
    saved = json.loads(path.read_text())
    wrong = [f"{k} {saved.get(k, 1)} there, {now} here" for k, now in (("pp", spec.pp), ("tp", spec.tp))
             if saved.get(k, 1) != now]
    if wrong:
        raise UsageError(f"--resume {ckpt_dir / tag}: saved with another parallel layout ({'; '.join(wrong)})\n"
                         f"    fix: resume with --set parallel.pipeline={saved.get('pp', 1)} --set "
                         f"parallel.tensor={saved.get('tp', 1)}, or export it (harness export) and start a new run "
                         "from the exported folder")


def load(engine, dist: DistInfo, ckpt_dir: Path, tag: str) -> dict:
    """Load a checkpoint into the engine; returns the client state (step, ...)."""
    path, client = engine.load_checkpoint(str(ckpt_dir), tag=tag)
    if path is None:
        raise RuntimeError(f"DeepSpeed found no checkpoint {ckpt_dir / tag}")
    rng = ckpt_dir / tag / f"rng_rank{dist.rank}.pt"
    if rng.is_file():
        _set_rng_state(torch.load(rng, weights_only=True))
    return client or {}
