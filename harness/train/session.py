"""Everything decided before ranks talk: the recipe, the resolved DeepSpeed config, the run folder.

Reads files and environment variables and probes this machine (harness.train.checks: DeepSpeed ops, paths,
free space), but starts nothing, so bad input fails identically on every rank with exit code 2, before any
process group exists.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from harness.errors import UsageError
from harness.config.jsonio import load_json
from harness.config.recipes import load_recipe
from harness.config.resolve import autotp, degrees
from harness.config.validate import check_ds_config, check_recipe, context, strip_annotations
from harness.train import checks

DEFAULT_RECIPE = "zero2_offload"


@dataclass
class RunSpec:
    recipe: dict
    recipe_name: str
    ds_config: dict  # resolved, what deepspeed.initialize gets
    provenance: dict
    warnings: list
    world_size: int
    pp: int
    tp: int
    output_dir: Path | None  # explicit --output-dir, else chosen by rank 0 after init
    resume: str | None
    overwrite: bool
    notes: list[str] = field(default_factory=list)
    layout: dict = field(default_factory=dict)  # pipeline partition, filled at engine build; checkpoint manifests
    resume_point: object = None  # harness.checkpoint.resume.ResumePoint when resuming
    dtypes: dict = field(default_factory=dict)  # checkpoint_dtype, train_dtype: filled at model build; manifests

    @property
    def sp(self) -> int:
        """Ulysses sequence-parallel degree (harness/model/sequence/)."""
        from harness.config.resolve import sequence_parallel

        return sequence_parallel(self.ds_config)

    @property
    def dp(self) -> int:
        return self.world_size // (self.pp * self.tp * self.sp)

    @property
    def zero_stage(self) -> int:
        return self.ds_config.get("zero_optimization", {}).get("stage", 0)


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def fp16_supported() -> bool:
    from deepspeed.accelerator import get_accelerator

    return bool(get_accelerator().is_fp16_supported())


def existing_checkpoints(run_dir: Path) -> list[str]:
    ckpt = run_dir / "checkpoints"
    return sorted(p.name for p in ckpt.glob("global_step*") if p.is_dir()) if ckpt.is_dir() else []


def _guard_output_dir(run_dir: Path, resume: str | None, overwrite: bool) -> None:
    """Never overwrite an earlier run's checkpoints or metrics by accident."""
    tags = existing_checkpoints(run_dir)
    has_outputs = tags or (run_dir / "metrics.jsonl").exists()
    if has_outputs and resume is None and not overwrite:
        held = ", ".join(tags[-3:]) or "metrics.jsonl"
        raise UsageError(f"{run_dir} already holds an earlier run ({held})\n"
                         "    fix: --resume latest to continue it, --overwrite to replace it, "
                         "or another --output-dir")
    if resume == "latest" and not tags:
        raise UsageError(f"--resume latest: no checkpoint in {run_dir / 'checkpoints'}\n"
                         "    fix: point --output-dir at the run to continue, or --resume PATH")


def _resume_point(output_dir: Path | None, resume: str | None):
    from harness.checkpoint import resume as resumemod

    return resumemod.find(resume, output_dir) if resume is not None and output_dir is not None else None


def _resume_recipe(name: str, overrides: list[str], point, world: int, notes: list[str]) -> tuple[dict, str]:
    """The recipe, with the checkpoint's global batch kept on this world size (see harness/checkpoint/resume.py)."""
    from harness.config.resolve import batch_world
    from harness.checkpoint import resume as resumemod

    recipe, source = load_recipe(name, overrides)
    if point is None:
        return recipe, source
    parallel = recipe["parallel"]
    replicas = batch_world(world, parallel["pipeline"], parallel["tensor"], sp=parallel["sequence"])[0]
    extra, note = resumemod.batch_overrides(point, recipe, replicas)
    notes.extend([note] if note else [])
    return load_recipe(name, overrides + extra) if extra else (recipe, source)


def _resume_layout(ds: dict, source: str, point, world: int, pp: int, tp: int, notes: list[str]) -> dict:
    """A checkpoint from another layout is loaded through DeepSpeed's universal form (converted at start)."""
    from harness.checkpoint import resume as resumemod

    if point is None:
        return ds
    resumemod.check_batch(point, ds, source)
    expert = resumemod.check_expert(point, ds)  # MoE: another expert degree goes through the universal form
    if not expert and not resumemod.needs_universal(point, world, pp, tp):
        return ds
    saved = point.layout()
    notes.append(f"resume: {point.tag} was saved on world {saved[0]} (pp {saved[1]}, tp {saved[2]}, expert "
                 f"{point.manifest.get('ep', 1)}), this launch is world {world} (pp {pp}, tp {tp}): loading it "
                 "through DeepSpeed's universal checkpoint")
    return {**ds, "checkpoint": {**ds.get("checkpoint", {}), "load_universal": True}}


def _output_dir(args, world: int) -> Path | None:
    output_dir = Path(args.output_dir) if args.output_dir else None
    if args.resume and args.resume != "latest" and output_dir is None:
        output_dir = _run_dir_of(Path(args.resume))
    if output_dir is not None:
        _guard_output_dir(output_dir, args.resume, args.overwrite)
    elif args.resume == "latest":
        raise UsageError("--resume latest needs --output-dir (the run folder to continue)")
    return output_dir


def prepare(args) -> RunSpec:
    """The run's spec, after every check that needs no process group (config, then this machine)."""
    spec = resolve_spec(args)
    checks.before_init(spec, args.ds_config)  # this machine: ops, model limits, paths and free space
    spec.ds_config = moe_blocks(spec)
    return spec


def moe_blocks(spec) -> dict:
    """A MoE model's ZeRO-3 leaf table and AutoEP preset in the DeepSpeed config (harness/model/moe/wiring.py)."""
    import torch

    from harness.model.moe.wiring import engine_blocks

    return engine_blocks(spec.ds_config, checks.model_config(spec.recipe["train"]["model"]),
                         cuda=torch.cuda.is_available())


def resolve_spec(args) -> RunSpec:
    world = world_size_from_env()
    output_dir = _output_dir(args, world)  # cheapest check first: never touch an earlier run
    point = _resume_point(output_dir, args.resume)
    name, overrides, notes = args.recipe or DEFAULT_RECIPE, list(args.overrides), []
    if name == "auto":
        from harness.train.auto_recipe import choose

        name, planned, reason = choose(overrides, world)
        overrides, notes = planned + overrides, [reason]
    recipe, source = _resume_recipe(name, overrides, point, world, notes)
    model_config = checks.inputs(recipe["train"], source)  # model and data exist; a hub model's shape, too
    ctx = context(recipe, world, fp16_supported=fp16_supported(), model_config=model_config)
    if args.ds_config:
        checked = check_ds_config(load_json(args.ds_config), ctx, args.ds_config)
    else:
        checked = check_recipe(recipe, ctx, source)
    ds = strip_annotations(checked.ds_config)
    pp, tp = degrees(ds, recipe)
    if autotp(ds, recipe):
        raise UsageError(f"{args.ds_config}: tensor_parallel.autotp_size {tp} asks for DeepSpeed's AutoTP; "
                         "harness/run.py splits the layers itself (one way for tp and 3D, with an mpu)\n"
                         f"    fix: remove the tensor_parallel block and pass --set parallel.tensor={tp} (DeepSpeed "
                         f"then counts world / {tp} data-parallel ranks in train_batch_size)")
    ds = _resume_layout(ds, args.ds_config or source, point, world, pp, tp, notes)
    return RunSpec(recipe=recipe, recipe_name=Path(name).stem, ds_config=ds, provenance=checked.provenance,
                   warnings=checked.warnings, world_size=world, pp=pp, tp=tp, output_dir=output_dir,
                   resume=args.resume, overwrite=args.overwrite, notes=notes, resume_point=point)


def _run_dir_of(ckpt: Path) -> Path:
    """The run folder holding a checkpoint path (run/, run/checkpoints or run/checkpoints/global_stepN)."""
    if not ckpt.exists():
        raise UsageError(f"--resume {ckpt}: no such checkpoint")
    for candidate in (ckpt, *ckpt.parents):
        if candidate.name == "checkpoints":
            return candidate.parent
        if (candidate / "checkpoints").is_dir():
            return candidate
    raise UsageError(f"--resume {ckpt}: not inside a run folder (expected .../checkpoints/global_stepN)")
