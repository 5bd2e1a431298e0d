"""Where a resumed run continues: which checkpoint, on which layout, with which global batch.

The pure part (find, batch_overrides, needs_universal) runs in session.prepare before any process group, so
a bad --resume exits 2 on every rank. `universal` runs on the ranks: rank 0 converts a checkpoint saved on
another layout (world size, tensor, pipeline or expert degree, ZeRO stage) once into DeepSpeed's universal form,
which the engine loads on any layout when its config says checkpoint.load_universal (relayout.py: the harness's
tensor-parallel slicing and pipeline names). Another sequence-parallel degree on the same world size needs no
conversion: ZeRO partitions over dp x sp ranks, the same count.

The global batch is the checkpoint's: the data order (BatchPlan) is a pure function of the step and the
global batch, so keeping it is what makes the data position continue exactly. When the recipe leaves
batch.train_batch_size to "auto" (it would otherwise follow the world size), the checkpoint's value is pinned
and gradient accumulation re-derived for this launch, keeping the recipe's micro batch (also when the recipe pins
the same train_batch_size with an accumulation made for the old world size). A recipe that pins a different
train_batch_size is refused: it cannot continue the same data order.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from argparse import Namespace
from dataclasses import dataclass
from pathlib import Path

from harness.errors import UsageError
from harness.checkpoint import files as ckpt_files
from harness.checkpoint.files import UNIVERSAL, is_complete, read_manifest, step_of

CONVERTED = "converted.json"  # written last into the conversion: marks it complete


@dataclass(frozen=True)
class ResumePoint:
    ckpt_dir: Path  # the checkpoints/ folder
    tag: str  # global_stepN
    manifest: dict
    skipped: tuple[str, ...] = ()  # newer folders without a manifest: saves that were interrupted

    @property
    def folder(self) -> Path:
        return self.ckpt_dir / self.tag

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    def layout(self) -> tuple[int, int, int]:
        m = self.manifest
        return int(m["world_size"]), int(m.get("pp", 1)), int(m.get("tp", 1))


def find(resume: str, run_dir: Path) -> ResumePoint:
    """--resume latest|PATH -> the checkpoint to load: the given global_stepN folder, or the newest complete
    checkpoint of a run / checkpoints folder (incomplete newer ones are skipped and reported)."""
    path = run_dir / "checkpoints" if resume == "latest" else Path(resume)
    if (path / "checkpoints").is_dir():
        path = path / "checkpoints"
    if step_of(path.name) is not None:
        if not is_complete(path):
            raise UsageError(f"--resume {path}: incomplete checkpoint (no {ckpt_files.MANIFEST}: its save was "
                             "interrupted)\n    fix: --resume latest (the newest complete one) or an older "
                             f"{ckpt_files.PREFIX}N")
        return ResumePoint(path.parent, path.name, read_manifest(path))
    found = ckpt_files.tags(path) if path.is_dir() else []
    complete = [t for t in found if is_complete(path / t)]
    if not complete:
        held = f" (only incomplete ones: {', '.join(found)})" if found else ""
        raise UsageError(f"--resume {resume}: no complete checkpoint in {path}{held}\n"
                         "    fix: point --output-dir at the run to continue, or --resume PATH")
    newest = complete[-1]
    skipped = tuple(t for t in found if step_of(t) > step_of(newest))
    return ResumePoint(path, newest, read_manifest(path / newest), skipped)


def needs_universal(point: ResumePoint, world_size: int, pp: int, tp: int, zero_stage: int,
                    precision: str = "fp32") -> bool:
    """A checkpoint whose optimizer state is sharded (ZeRO, or DeepSpeed's bf16 optimizer) loads only on its
    own layout and partitioning (ZeRO-1 and 2 share one); elsewhere it goes through the universal form.
    Unsharded state (ZeRO-0 fp32) loads anywhere on the same tensor and pipeline degrees; to or from another stage,
    tensor or pipeline degree it goes through the universal form too, which the harness writes and reads for
    ZeRO-0 itself (zero0.py) when that side trains fp32 without tensor or pipeline parallelism. Refused before any
    rank starts: the other ZeRO-0 changes, and a tensor-parallel checkpoint saved before the harness declared its
    slicing (relayout.py)."""
    world, was_pp, was_tp = point.layout()
    stages = (int(point.manifest.get("zero_stage", 0)), zero_stage)
    saved = f"saved on world {world} with pipeline {was_pp}, tensor {was_tp}, ZeRO-{stages[0]}"
    here = f"this launch is world {world_size} with pipeline {pp}, tensor {tp}, ZeRO-{stages[1]}"
    same = f"launch {world} ranks with pipeline {was_pp}, tensor {was_tp}"
    zero0_change = 0 in stages and (stages[0] != stages[1] or (was_pp, was_tp) != (pp, tp))
    if zero0_change:
        _check_zero0_sides([("saved", stages[0], was_pp, was_tp, point.manifest.get("precision", "fp32")),
                            ("launched", stages[1], pp, tp, precision)], point, f"{saved}; {here}", same)
        return True
    if point.layout() == (world_size, pp, tp) and (stages[0] == stages[1] or 3 not in stages):
        return False
    if was_tp > 1 and not point.manifest.get("universal_patterns"):
        raise UsageError(f"--resume {point.folder}: {saved}; {here}: the checkpoint was written before the "
                         "harness declared how its tensor-parallel layers split, so its shards cannot be joined\n"
                         f"    fix: {same}, or `harness export {point.folder} --out DIR` and start a new run from DIR")
    return any(point.folder.glob("*optim_states.pt"))


def _check_zero0_sides(sides: list[tuple], point: ResumePoint, layouts: str, same: str) -> None:
    """Each ZeRO-0 side of a layout change, (name, stage, pp, tp, precision), must train fp32 on pipeline 1 and
    tensor 1 (zero0.py builds that conversion only); else refused."""
    for side, stage, pp, tp, precision in sides:
        if stage == 0 and (pp, tp, precision) != (1, 1, "fp32"):
            raise UsageError(f"--resume {point.folder}: {layouts}: a layout change with ZeRO-0 goes through the "
                             "universal checkpoint, which the harness writes and reads for ZeRO-0 in fp32 without "
                             f"tensor or pipeline parallelism only (the {side} side is pipeline {pp}, tensor {tp}, "
                             f"{precision})\n    fix: {same} on ZeRO-{sides[0][1]}, or ZeRO-1 or above on the {side} "
                             "side, or precision=fp32 with parallel.pipeline=1 and parallel.tensor=1 there")


def check_expert(point: ResumePoint, ds: dict) -> bool:
    """True when the checkpoint's expert degree (DeepSpeed AutoEP's parallel.expert) differs from this launch's: it
    then loads through the universal form, rewritten by rank 0 into this launch's expert layout
    (checkpoint/expert_layout.py; a ZeRO-3 save's experts are gathered by ds_to_universal, relayout.for_every_stage
    shapes them). Refused before any rank starts where that path is not built or not tested: ZeRO-0 on either side
    (no universal form) and LoRA."""
    from harness.checkpoint.save import expert_degree

    saved, here = int(point.manifest.get("ep", 1)), expert_degree(ds)
    if saved == here:
        return False
    stages = (int(point.manifest.get("zero_stage", 0)), int(ds.get("zero_optimization", {}).get("stage", 0)))
    lora = point.manifest.get("adapter", {}).get("type", "none") != "none"
    why = ("ZeRO-0" if 0 in stages else "LoRA" if lora else None)
    if why is not None:
        raise UsageError(f"--resume {point.folder}: saved with parallel.expert={saved} (ZeRO-{stages[0]}), this "
                         f"launch asks parallel.expert={here} (ZeRO-{stages[1]}): changing the expert degree goes "
                         "through DeepSpeed's universal checkpoint with the experts rewritten between AutoEP's "
                         f"and transformers' layout, built and tested for full fine-tuning on ZeRO-1/2/3 only ({why} "
                         "here)\n"
                         f"    fix: --set parallel.expert={saved}, or resume on ZeRO-1 or above on both sides, or "
                         f"`harness export {point.folder} --out DIR` and start a new run from DIR (train.model=DIR; "
                         "the optimizer state starts afresh)")
    return True


def batch_overrides(point: ResumePoint, recipe: dict, batch_world: int) -> tuple[list[str], str | None]:
    """Recipe overrides that keep the checkpoint's global batch on this launch, and a note saying so.
    batch_world: the world size DeepSpeed's batch arithmetic uses here (config.resolve.batch_world)."""
    saved = point.manifest.get("train_batch_size")
    batch = recipe["batch"]
    if saved is None:  # a checkpoint from before the manifest recorded its batch
        return [], None
    asked = batch["train_batch_size"]
    if asked not in ("auto", saved):
        raise UsageError(f"--resume {point.folder}: it trained with global batch {saved}, batch.train_batch_size"
                         f" asks {asked}: the data order would not continue where it stopped\n"
                         f"    fix: --set batch.train_batch_size={saved}, or start a new run")
    micro = batch["micro_batch_per_gpu"]
    if not isinstance(micro, int):
        return [f"batch.train_batch_size={saved}"], None
    if saved % (micro * batch_world):
        fix = (f"--set batch.micro_batch_per_gpu=M with M dividing {saved // batch_world}" if saved % batch_world == 0
               else f"launch a number of ranks that divides {saved}")
        raise UsageError(f"--resume {point.folder}: it trained with global batch {saved}; here {saved} is not a "
                         f"multiple of micro {micro} x {batch_world} ranks = {micro * batch_world}\n    fix: {fix}")
    accum = saved // (micro * batch_world)
    note = None
    if accum != batch["grad_accum_steps"]:
        m = point.manifest
        note = (f"resume: global batch {saved} kept from {point.tag} ({m.get('micro_batch_per_gpu')} micro x "
                f"{m.get('grad_accum_steps')} accum x {m['world_size'] // (m.get('pp', 1) * m.get('tp', 1))} dp); "
                f"here {micro} micro x {accum} accum x {batch_world}")
    return [f"batch.train_batch_size={saved}", f"batch.grad_accum_steps={accum}"], note


def check_batch(point: ResumePoint, ds: dict, source: str) -> None:
    """The resolved config (a --ds-config included) must keep the checkpoint's global batch."""
    saved, got = point.manifest.get("train_batch_size"), ds.get("train_batch_size")
    if saved is not None and got is not None and saved != got:
        raise UsageError(f"--resume {point.folder}: it trained with global batch {saved}, {source} gives "
                         f"train_batch_size {got}: the data order would not continue where it stopped\n"
                         f"    fix: train_batch_size {saved} (micro x accum x data-parallel ranks), or start a new run")


def universal(point: ResumePoint, dist, ep: int = 1) -> tuple[Path, str, bool]:
    """(checkpoints folder, tag, converted here) of the universal form of `point`, converting it once (rank 0;
    the others wait), its MoE experts in the layout of a launch on parallel.expert=ep. Atomic: built in a hidden
    folder, marked complete, then renamed into place; a finished one is reused (an interrupted expert rewrite is
    redone). Parameters are under their HF names (relayout.py), whatever the saving layout."""
    from harness.checkpoint import expert_layout, relayout
    from harness.dist import barrier
    from harness.log import say

    root = point.ckpt_dir / UNIVERSAL
    out = root / point.tag
    converted = False
    if dist.is_main:
        marker = _marker(out)
        if marker is not None and (expert_layout.form(marker) not in expert_layout.FORMS
                                   or marker.get("relayout") != relayout.FORM_VERSION):
            say("ckpt", f"{out}: an expert rewrite was interrupted, or an older harness converted it; converting "
                        "again")
            shutil.rmtree(out)
            marker = None
        if marker is not None:
            say("ckpt", f"reusing the universal form of {point.tag} in {out}")
        else:
            world, pp, tp = point.layout()
            say("ckpt", f"{point.folder} was saved on world size {world} (pp {pp}, tp {tp}, expert "
                        f"{point.manifest.get('ep', 1)}): converting it once to DeepSpeed's universal checkpoint in "
                        f"{out}, which loads on any layout")
            _convert(point.folder, root, out)
            marker, converted = _marker(out), True
        _expert_layout(point, out, marker, ep, say)
    barrier()
    return root, point.tag, converted


def _marker(out: Path) -> dict | None:
    return json.loads((out / CONVERTED).read_text()) if (out / CONVERTED).is_file() else None


def _expert_layout(point: ResumePoint, out: Path, marker: dict, ep: int, say) -> None:
    """MoE: the universal folder rewritten for a launch on parallel.expert=ep (nothing to do for a dense model or
    when it is in that layout already); the marker says 'rewriting' while it runs."""
    from harness.checkpoint import expert_layout
    from harness.config import moe_families

    config = point.ckpt_dir / "hf" / "config.json"
    family = moe_families.family_of(json.loads(config.read_text())) if config.is_file() else None
    want = expert_layout.layout_for(ep)
    if family is None or family.autoep_preset is None or expert_layout.form(marker) == want:
        return
    (out / CONVERTED).write_text(json.dumps({**marker, expert_layout.FORM: "rewriting"}) + "\n")
    was, now, blocks = expert_layout.rewrite(out, marker, family, ep)
    (out / CONVERTED).write_text(json.dumps({**marker, expert_layout.FORM: now}) + "\n")
    say("ckpt", f"universal {point.tag}: experts of {blocks} MoE blocks rewritten from {was}'s layout to {now}'s "
                f"(parallel.expert={ep})")


def _convert(source: Path, root: Path, out: Path) -> None:
    from deepspeed.checkpoint import ds_to_universal

    from harness.checkpoint import relayout

    tmp = root / f".{out.name}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    args = Namespace(input_folder=str(source), output_folder=str(tmp), num_extract_workers=1, num_merge_workers=1,
                     keep_temp_folder=False, strict=True, inject_missing_state=True)
    if int(read_manifest(source).get("zero_stage", 0)) == 0:  # ds_to_universal reads ZeRO optimizer files only
        from harness.checkpoint import zero0

        zero0.to_universal(source, tmp)
    else:
        from harness.checkpoint import moments

        keys = moments.missing(source)  # plain SGD, Lion, Adagrad: filled in, converted, dropped after the load
        if keys:
            args.input_folder = str(moments.staged(source, tmp.with_name(tmp.name + ".staged"), keys))
        with open(tmp / "conversion.log", "w") as log, contextlib.redirect_stdout(log):
            ds_to_universal.main(args)  # in this process: worker pools would fork a rank holding a process group
        shutil.rmtree(tmp.with_name(tmp.name + ".staged"), ignore_errors=True)
        moments.record(tmp, keys)
    (root / "latest_universal").unlink(missing_ok=True)  # it writes one naming the hidden folder; tags are explicit
    relayout.to_hf_names(tmp / "zero", read_manifest(source))
    relayout.set_cat_dims(tmp / "zero")
    relayout.for_every_stage(tmp)
    from harness.checkpoint import expert_layout

    (tmp / CONVERTED).write_text(json.dumps({"source": str(source), "relayout": relayout.FORM_VERSION,
                                             expert_layout.FORM: expert_layout.source_form(tmp / "zero")}) + "\n")
    if out.exists():  # a conversion interrupted before its marker
        shutil.rmtree(out)
    os.replace(tmp, out)
