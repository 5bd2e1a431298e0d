"""Checkpoints: DeepSpeed's own layout plus what the harness needs to resume and export.

checkpoints/
  zero_to_fp32.py, global_stepN/...           DeepSpeed (save/load are collective: every rank calls)
  global_stepN/manifest.json                  world size, stage, tp, pp, dp, batch, precision, checkpoint_dtype
                                              (the loaded weights'), train_dtype (the engine's), versions, recipe
  global_stepN/rng_rank{R}.pt                 per-rank RNG states (client_state is rank 0's only)
  latest                                      tag of the newest COMPLETE checkpoint (written by the harness)
  universal/global_stepN/                     DeepSpeed universal form, made once to resume on another layout
  hf/                                         model config + tokenizer, for `harness export`

A save is complete once its manifest exists: rank 0 writes it after every rank has written its files, then
points `latest` at it (both by rename, so a kill at any moment leaves the old or the new file, never half of
one). DeepSpeed's own `latest` is turned off: it would name the tag before the manifest marks it complete.
Retention (train.keep_last) runs after that, so it only ever deletes checkpoints older than a complete one.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from harness.checkpoint import adam_powers, moments, relayout, zero0
from harness.checkpoint.files import LATEST, MANIFEST, is_complete, prune, tag_for, write_atomic
from harness.config.adapter_rules import lora_on
from harness.dist import DistInfo, barrier


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


def schedule_of(ds_config: dict) -> dict:
    """What decides the lr at each step, flat: the optimizer's lr and the scheduler's type and params (a resume
    compares it with its own: harness/train/schedule.py)."""
    block = ds_config.get("scheduler") or {"type": "none"}
    flat = {"optimizer.lr": ds_config.get("optimizer", {}).get("params", {}).get("lr"),
            "scheduler.type": block.get("type")}
    flat.update({f"scheduler.{k}": v for k, v in (block.get("params") or {}).items()})
    return flat


def manifest(spec, info, step: int) -> dict:
    """`info`: the built model's ModelInfo (harness/model/load/meta.py): its dtypes and a pipeline's partition."""
    import deepspeed
    import transformers

    run = spec.run
    return {"step": step, "world_size": spec.world_size, "zero_stage": spec.zero_stage, "tp": spec.tp,
            "pp": spec.pp, "dp": spec.dp, "ep": run.degrees.ep, "train_batch_size": run.batch.global_batch,
            "micro_batch_per_gpu": run.batch.micro_batch, "grad_accum_steps": run.batch.grad_accum,
            "offload": _offload(spec.ds_config), "precision": run.precision, "recipe": spec.recipe_name,
            "model": run.model, "deepspeed": deepspeed.__version__,
            "adapter": spec.recipe.get("adapter", {"type": "none"}), "seed": spec.recipe["train"]["seed"],
            "torch": torch.__version__, "transformers": transformers.__version__,
            "checkpoint_dtype": info.checkpoint_dtype, "train_dtype": info.train_dtype, "sp": run.degrees.sp,
            "universal_patterns": relayout.PATTERNS_VERSION, "schedule": schedule_of(spec.ds_config),
            **({"partition": info.partition} if info.partition else {})}


def expert_degree(ds: dict) -> int:
    """DeepSpeed AutoEP's degree (1: experts not split); its checkpoints load on the same degree only."""
    block = ds.get("expert_parallel") or {}
    return int(block.get("autoep_size", 1)) if block.get("enabled") else 1


def _offload(ds: dict) -> dict:
    zero = ds.get("zero_optimization", {})
    return {k: zero.get(k, {}).get("device", "none") for k in ("offload_optimizer", "offload_param")}


def save_hf_files(ckpt_dir: Path, config, tokenizer, image_processor=None) -> None:
    """Model config + tokenizer (+ a vision-language model's image processor) once per run (rank 0), so export
    needs nothing but the checkpoint folder."""
    hf = ckpt_dir / "hf"
    if not (hf / "config.json").exists():
        hf.mkdir(parents=True, exist_ok=True)
        config.save_pretrained(hf)
        tokenizer.save_pretrained(hf)
        if image_processor is not None:
            image_processor.save_pretrained(hf)


@torch.no_grad()
def probe_logits(engine, probe_ids: torch.Tensor) -> torch.Tensor | None:
    """The engine's logits on a fixed batch (collective under ZeRO-3 and pipelines: every rank calls; a
    pipeline returns them on rank 0 only)."""
    from harness.model.parallel import pipe_engine

    if pipe_engine.is_pipeline(engine):
        return pipe_engine.probe_logits(engine, probe_ids)
    was_training = engine.training
    engine.eval()
    if getattr(engine, "sequence_parallel_size", 1) > 1:  # Ulysses: each SP rank its slice, gathered
        from harness.model.sequence.ulysses import probe_logits as sequence_probe

        logits = sequence_probe(engine, probe_ids)
        engine.train(was_training)
        return logits
    logits = engine(input_ids=probe_ids.to(engine.device), use_cache=False).logits.float().cpu()
    engine.train(was_training)
    return logits


def save(engine, spec, dist: DistInfo, ckpt_dir: Path, step: int, client_state: dict,
         probe_ids: torch.Tensor | None = None, *, model_info) -> Path:
    """`model_info`: the built model's ModelInfo, for the manifest."""
    tag = tag_for(step)
    folder = ckpt_dir / tag
    if is_complete(folder):
        raise RuntimeError(f"refusing to overwrite checkpoint {folder}")  # guarded earlier; invariant
    if dist.is_main and folder.exists():  # an interrupted save of this step (reported at resume): start afresh
        shutil.rmtree(folder)
    barrier()
    _declare_universal_info(engine.module)
    # LoRA: the frozen base is rebuilt from train.model at resume and export; only adapters are state
    names = zero0.param_names(engine) if engine.zero_optimization_stage() == 0 else None
    if names is not None:  # ZeRO-0's optimizer state is by index: names for a layout change
        client_state = {**client_state, zero0.NAMES: names}
    engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=client_state, save_latest=False,
                           exclude_frozen_parameters=frozen_excluded(spec))
    torch.save(_rng_state(), folder / f"rng_rank{dist.rank}.pt")
    sp = getattr(engine, "sequence_parallel_size", 1)
    if probe_ids is not None and sp > 1:  # the probe's tokens split over the SP ranks
        probe_ids = probe_ids[:, :probe_ids.shape[1] - probe_ids.shape[1] % sp] if probe_ids.shape[1] >= sp else None
    if probe_ids is not None:  # lets `harness export` verify the exported weights against this engine
        logits = probe_logits(engine, probe_ids)
        if dist.is_main:
            torch.save({"input_ids": probe_ids, "logits": logits}, folder / "probe.pt")
    barrier()  # every rank's files are written
    if dist.is_main:
        text = json.dumps(manifest(spec, model_info, step), indent=2) + "\n"
        write_atomic(folder / MANIFEST, text)  # complete from here
        write_atomic(ckpt_dir / LATEST, tag + "\n")
        prune(ckpt_dir, spec.recipe["train"]["keep_last"])
    barrier()
    return folder


def _declare_universal_info(module) -> None:
    """ds_to_universal (resume on another layout) needs this in the model states; DeepSpeed fills it itself only
    for AutoTP. A model the harness can split by tensor (parallel/tensor.py) declares how: the universal form then
    holds whole tensors, each marked with the dimension a tensor-parallel launch cuts it along."""
    from deepspeed.checkpoint.constants import (UNIVERSAL_CHECKPOINT_INFO, UNIVERSAL_CHECKPOINT_VERSION_KEY,
                                                UNIVERSAL_CHECKPOINT_VERSION_VALUE)

    if getattr(module, UNIVERSAL_CHECKPOINT_INFO, None) is None:
        from harness.checkpoint import relayout

        info = {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}
        setattr(module, UNIVERSAL_CHECKPOINT_INFO, {**info, **relayout.tp_patterns(module)})


def frozen_excluded(spec) -> bool:
    return lora_on(spec.recipe)


def load(engine, dist: DistInfo, ckpt_dir: Path, tag: str, rng_dir: Path | None = None,
         strict: bool = True) -> dict:
    """Load a checkpoint into the engine; returns the client state (step, ...). rng_dir: where the per-rank RNG
    files are when the weights come from elsewhere (a universal conversion). strict=False: a LoRA checkpoint
    holds no frozen weights (the engine already has them from the build)."""
    if engine.zero_optimization_stage() == 0 and engine.load_universal_checkpoint():  # DeepSpeed's loads no state
        client = zero0.load_universal(engine, ckpt_dir / tag)
    else:
        path, client = engine.load_checkpoint(str(ckpt_dir), tag=tag, load_module_strict=strict)
        if path is None:
            raise RuntimeError(f"DeepSpeed found no checkpoint {ckpt_dir / tag}")
        if engine.load_universal_checkpoint():
            moments.drop(engine, ckpt_dir / tag)  # what the conversion filled in for a moment-less optimizer
    adam_powers.rebuild(adam_powers.base_optimizer(engine))  # the CPU Adam kernel's beta^t: no checkpoint holds it
    client = client or {}
    rng = (rng_dir or ckpt_dir / tag) / f"rng_rank{dist.rank}.pt"
    if rng.is_file():
        _set_rng_state(torch.load(rng, weights_only=True))
    else:  # a rank the checkpoint did not have (resumed on more ranks): its own seed, distinct per rank
        _seed_all(int(client.get("seed", 0)) + 1000003 * (dist.rank + 1) + int(client.get("step", 0)))
    return client


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
