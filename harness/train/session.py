"""Everything decided before ranks talk: the recipe, the resolved DeepSpeed config, the run folder.

Reads files and probes this machine (harness.train.checks: DeepSpeed ops, paths,
free space), but starts nothing, so bad input fails identically on every rank with exit code 2, before any
process group exists.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields
from pathlib import Path

from harness.dist import Launch
from harness.errors import RunComplete, UsageError
from harness.config.jsonio import load_json
from harness.config.recipes import load_recipe
from harness.config.resolve import autotp, degrees, sequence_parallel
from harness.config.run_model import Degrees, RunModel
from harness.config.validate import check_ds_config, check_recipe, context, strip_annotations
from harness.train import checks

DEFAULT_RECIPE = "zero2_offload"


@dataclass(frozen=True)
class AskedDegrees(Degrees):
    """Degrees as a launch asks for them, before checks.before_init has judged them: they may not divide the world
    yet (dp then rounds down), so they are not refused here but there, with the arithmetic and the fix."""

    def __post_init__(self):
        pass


@dataclass(frozen=True)
class Resolved:
    """The launch as asked: the recipe and DeepSpeed dict resolved and schema-checked for this world, the model's
    HF config read once. Not yet judged against this machine and the rules that need the model
    (checks.before_init)."""

    recipe: dict
    recipe_name: str
    ds_config: dict  # resolved, what deepspeed.initialize gets
    provenance: dict
    warnings: tuple
    model_config: dict  # the model's HF config dict (checks.inputs), the one read of it
    launch: Launch
    output_dir: Path | None  # explicit --output-dir, else chosen by rank 0 after init
    resume: str | None
    overwrite: bool
    notes: tuple[str, ...] = ()  # for the start-up lines (the auto recipe's reason, resume's conversions)
    resume_point: object = None  # harness.checkpoint.resume.ResumePoint when resuming

    def _degrees(self) -> Degrees:
        pp, tp = degrees(self.ds_config, self.recipe)
        return AskedDegrees(self.launch.world_size, tp=tp, pp=pp, sp=sequence_parallel(self.ds_config))

    def _zero_stage(self) -> int:
        return self.ds_config.get("zero_optimization", {}).get("stage", 0)

    # one reader each; RunSpec answers them from spec.run
    world_size = property(lambda self: self._degrees().world)
    pp = property(lambda self: self._degrees().pp)
    tp = property(lambda self: self._degrees().tp)
    sp = property(lambda self: self._degrees().sp, doc="Ulysses sequence-parallel degree (harness/model/sequence/)")
    dp = property(lambda self: self._degrees().dp, doc="Data-parallel replicas: each reads its own micro-batches.")
    zero_shards = property(lambda self: self._degrees().zero_shards, doc="The ZeRO group: dp x sp ranks.")
    zero_stage = property(lambda self: self._zero_stage())


@dataclass(frozen=True)
class RunSpec(Resolved):
    """The run, once every check before init has passed and the DeepSpeed dict is final: `run` is the one typed
    value its degrees, batch and ZeRO settings are read from (harness/config/run_model.py)."""

    run: RunModel = field(kw_only=True)

    @classmethod
    def of(cls, asked: Resolved, ds_config: dict) -> "RunSpec":
        run = RunModel.from_resolved(asked.recipe, ds_config, asked.launch.world_size, asked.model_config)
        kept = {f.name: getattr(asked, f.name) for f in fields(Resolved)}
        return cls(**{**kept, "ds_config": ds_config}, run=run)

    def _degrees(self) -> Degrees:
        return self.run.degrees

    def _zero_stage(self) -> int:
        return self.run.zero.stage


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


def _check_not_complete(point, steps: int) -> None:
    """A finished run resumed (a requeue or restart after its last step, a resubmitted job): say so and stop."""
    if point is None or point.step < steps:
        return
    where = "its last step" if point.step == steps else f"past train.steps {steps}"
    raise RunComplete(f"{point.folder} is step {point.step}, {where}: the run is complete, nothing to train and "
                      f"nothing written\n    to train further: --resume {point.folder} --set train.steps=N "
                      f"(N > {point.step})")


def _resume_layout(ds: dict, source: str, point, world: int, pp: int, tp: int, notes: list[str]) -> dict:
    """A checkpoint from another layout is loaded through DeepSpeed's universal form (converted at start)."""
    from harness.checkpoint import resume as resumemod

    if point is None:
        return ds
    resumemod.check_batch(point, ds, source)
    expert = resumemod.check_expert(point, ds)  # MoE: another expert degree goes through the universal form
    stage = int(ds.get("zero_optimization", {}).get("stage", 0))
    precision = "bf16" if ds.get("bf16", {}).get("enabled") else "fp16" if ds.get("fp16", {}).get("enabled") else "fp32"
    if not expert and not resumemod.needs_universal(point, world, pp, tp, stage, precision):
        return ds
    from harness.checkpoint.moments import refusal

    why = refusal(ds)
    if why:
        raise UsageError(f"--resume {point.folder}: saved on another layout than this launch's, so it loads through "
                         f"DeepSpeed's universal checkpoint; {why}\n    fix: resume on the saving layout (world "
                         f"{point.layout()[0]}, ZeRO-{point.manifest.get('zero_stage', 0)}), or train with momentum 0 "
                         "or optimizer.type=adamw where the layout must change")
    saved = point.layout()
    notes.append(f"resume: {point.tag} was saved on world {saved[0]} (pp {saved[1]}, tp {saved[2]}, expert "
                 f"{point.manifest.get('ep', 1)}, ZeRO-{point.manifest.get('zero_stage', 0)}), this launch is world "
                 f"{world} (pp {pp}, tp {tp}, ZeRO-{stage}): loading it through DeepSpeed's universal checkpoint")
    return {**ds, "checkpoint": {**ds.get("checkpoint", {}), "load_universal": True}}


def auto_resume(output_dir: Path) -> str | None:
    """--resume auto: "latest" when output_dir holds a complete checkpoint, else None (start fresh). A restarted
    pod or a requeued job reruns the same command, which then continues the run or begins it."""
    from harness.train.restarts import newest_complete

    return "latest" if newest_complete(output_dir) else None


def _resolve_auto(args):
    """args with --resume auto decided against --output-dir (a copy; other values unchanged)."""
    if args.resume != "auto":
        return args
    if not args.output_dir:
        raise UsageError("--resume auto needs --output-dir: the run folder whose latest checkpoint a rerun of the "
                         "same command continues\n    fix: --output-dir RUN_DIR --resume auto")
    return argparse.Namespace(**{**vars(args), "resume": auto_resume(Path(args.output_dir))})


def _output_dir(args, world: int) -> Path | None:
    output_dir = Path(args.output_dir) if args.output_dir else None
    if args.resume and args.resume != "latest" and output_dir is None:
        output_dir = _run_dir_of(Path(args.resume))
    if output_dir is not None:
        _guard_output_dir(output_dir, args.resume, args.overwrite)
    elif args.resume == "latest":
        raise UsageError("--resume latest needs --output-dir (the run folder to continue)")
    return output_dir


def prepare(args, launch: Launch) -> RunSpec:
    """The run's spec, after every check that needs no process group (config, then this machine)."""
    asked = resolve_spec(args, launch)
    checks.before_init(asked, args.ds_config)  # this machine: ops, model limits, paths and free space
    return RunSpec.of(asked, moe_blocks(asked))


def moe_blocks(asked: Resolved) -> dict:
    """A MoE model's ZeRO-3 leaf table and AutoEP preset in the DeepSpeed config (harness/model/moe/wiring.py)."""
    import torch

    from harness.model.moe.wiring import engine_blocks

    return engine_blocks(asked.ds_config, asked.model_config, cuda=torch.cuda.is_available())


def resolve_spec(args, launch: Launch) -> Resolved:
    """The recipe and DeepSpeed dict for `launch`'s world, checked as config (exit 2 on a bad one)."""
    world = launch.world_size
    args = _resolve_auto(args)
    output_dir = _output_dir(args, world)  # cheapest check first: never touch an earlier run
    point = _resume_point(output_dir, args.resume)
    name, overrides, notes = args.recipe or DEFAULT_RECIPE, list(args.overrides), []
    if name == "auto":
        from harness.train.auto_recipe import choose

        name, planned, reason = choose(overrides, launch)
        overrides, notes = planned + overrides, [reason]
    recipe, source = _resume_recipe(name, overrides, point, world, notes)
    _check_not_complete(point, recipe["train"]["steps"])
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
    return Resolved(recipe=recipe, recipe_name=Path(name).stem, ds_config=ds, provenance=checked.provenance,
                    warnings=tuple(checked.warnings), model_config=model_config, launch=launch,
                    output_dir=output_dir, resume=args.resume, overwrite=args.overwrite, notes=tuple(notes),
                    resume_point=point)


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
