"""Fill "auto" values for a concrete launch, recording where each value came from.

HF-style configs (Axolotl, LLaMA-Factory presets) write "auto" for values only the HF Trainer
resolves; DeepSpeed itself drops "auto" inside its pydantic blocks and crashes on it at top level.
Here every "auto" is filled from the run settings (the recipe), the world size, or the model shape,
and an "auto" that cannot be filled is an error naming it.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass

from harness.errors import Problem
from harness.config.builder import schedule_total
from harness.config.defaults import MODEL_SIZED_BUCKETS
from harness.config.jsonio import get_path

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
RECIPE_BATCH = {"train_batch_size": "batch.train_batch_size",
                "train_micro_batch_size_per_gpu": "batch.micro_batch_per_gpu",
                "gradient_accumulation_steps": "batch.grad_accum_steps"}


@dataclass(frozen=True)
class Context:
    """What a config is checked against: the run settings, and (when known) world and model."""
    recipe: dict
    world_size: int | None = None
    model: dict | None = None  # model_shapes.shape_summary()
    model_name: str = ""
    fp16_supported: bool | None = None  # None: not checked (no device at hand)


def is_count(value) -> bool:
    """A batch number as the schema accepts it: an int or an integral float (5e8 style), not a bool."""
    if isinstance(value, float):
        return value.is_integer()  # inf and nan are not
    return isinstance(value, int) and not isinstance(value, bool)


def degrees(ds: dict, recipe: dict) -> tuple[int, int]:
    """(pipeline, tensor) degrees: the recipe's when set, else what the DeepSpeed dict says."""
    pp = recipe["parallel"]["pipeline"]
    tp = recipe["parallel"]["tensor"]
    stages = ds["pipeline"].get("stages") if isinstance(ds.get("pipeline"), dict) else None
    if pp == 1 and is_count(stages) and stages >= 1:  # 0 or -1 is the schema's to report, not a degree
        pp = int(stages)
    if tp == 1 and autotp(ds, recipe):
        tp = int(ds["tensor_parallel"]["autotp_size"])
    return pp, tp


def autotp(ds: dict, recipe: dict) -> bool:
    """True when the tensor degree is DeepSpeed's AutoTP (tensor_parallel.autotp_size in a DeepSpeed dict)
    rather than the recipe's parallel.tensor (layers the harness splits itself, with an mpu)."""
    block = ds.get("tensor_parallel")
    size = block.get("autotp_size") if isinstance(block, dict) else None
    return recipe["parallel"]["tensor"] == 1 and is_count(size) and size > 1


def sequence_parallel(ds: dict) -> int:
    """sequence_parallel_size of a DeepSpeed dict (1 when absent or malformed: the schema reports that)."""
    sp = ds.get("sequence_parallel_size", 1)
    return int(sp) if is_count(sp) and sp >= 1 else 1


def batch_world(world: int, pp: int, tp: int, auto_tp: bool = False, sp: int = 1) -> tuple[int, str]:
    """The world size DeepSpeed's batch assertion uses, and why.

    With an mpu (the harness's tensor-parallel layers) or a PipelineModule: the data-parallel world,
    world / (pp * tp). DeepSpeed's AutoTP (a DeepSpeed dict's autotp_size) counts its tensor-parallel
    ranks as data-parallel ranks: the FULL world.
    """
    if sp > 1:  # runtime/config.py: dist world / sequence_parallel_size when the config gives it
        return world // sp, f"world {world} / sequence_parallel_size {sp}"
    if pp > 1:
        return world // (pp * tp), f"world {world} / (pipeline {pp} x tensor {tp})"
    if auto_tp:
        return world, f"world {world} (AutoTP: DeepSpeed counts the {tp} tensor ranks in its batch check)"
    if tp > 1:
        return world // tp, f"world {world} / tensor {tp}"
    return world, f"world {world}"


class _Filler:
    def __init__(self, ds: dict):
        self.ds = ds
        self.provenance: dict[str, dict] = {}
        self.problems: list[Problem] = []

    def fill(self, path: str, value, source: str) -> None:
        node = self.ds
        *parents, leaf = path.split(".")
        for key in parents:
            node = node[key]
        node[leaf] = value
        self.provenance[path] = {"value": value, "source": source}


def _resolve_batch(f: _Filler, ctx: Context, pp: int, tp: int) -> None:
    """"auto" batch keys take the run settings (as the HF Trainer fills them from its arguments) until two are
    fixed; absent keys follow DeepSpeed's own rule (runtime/config.py _set_batch_related_parameters): only
    train_batch_size -> accumulation 1, micro = batch / world; nothing -> refused."""
    if ctx.world_size is None:
        return
    world, why = batch_world(ctx.world_size, pp, tp, autotp(f.ds, ctx.recipe), sequence_parallel(f.ds))
    if world < 1:
        return  # degree problems are reported by the rules
    vals = {k: f.ds.get(k) for k in BATCH_KEYS}
    if any(v not in (None, "auto") and not (is_count(v) and v >= 1) for v in vals.values()):
        return  # a malformed value is the schema's to report; filling around it would hide it
    vals = {k: int(v) if is_count(v) else v for k, v in vals.items()}
    batch = ctx.recipe["batch"]
    # the HF Trainer computes an "auto" train_batch_size from its own micro batch and accumulation
    from_settings = {k for k, v in vals.items() if v == "auto" or (v is None and vals["train_batch_size"] == "auto")}
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size"):
        if sum(isinstance(v, int) for v in vals.values()) >= 2:
            break
        if key in from_settings and isinstance(batch[RECIPE_BATCH[key].split(".")[1]], int):
            vals[key] = batch[RECIPE_BATCH[key].split(".")[1]]
            f.fill(key, vals[key], f"recipe {RECIPE_BATCH[key]}")
    if sum(isinstance(v, int) for v in vals.values()) == 1 and vals["gradient_accumulation_steps"] is None:
        _deepspeed_default_accumulation(f, vals)
    tbs, micro, gas = (vals[k] for k in BATCH_KEYS)
    if sum(isinstance(v, int) for v in (tbs, micro, gas)) < 2:
        f.problems.append(Problem("train_batch_size", "cannot resolve the batch: DeepSpeed needs train_batch_size or "
                                  "train_micro_batch_size_per_gpu, and at most one of the three is a number here",
                                  "give train_batch_size, or train_micro_batch_size_per_gpu (and optionally "
                                  "gradient_accumulation_steps)"))
        return
    _derive_third(f, tbs, micro, gas, world, why)


def _deepspeed_default_accumulation(f: _Filler, vals: dict) -> None:
    """One of train_batch_size / micro batch given, accumulation absent: DeepSpeed takes accumulation 1."""
    vals["gradient_accumulation_steps"] = 1
    f.fill("gradient_accumulation_steps", 1, "DeepSpeed's default when only one batch size is given")


def _derive_third(f: _Filler, tbs, micro, gas, world: int, why: str) -> None:
    if not isinstance(tbs, int):
        f.fill("train_batch_size", micro * gas * world, f"micro {micro} x accum {gas} x {why}")
    elif not isinstance(micro, int):
        if tbs % (gas * world):
            f.problems.append(Problem("train_batch_size", f"train_batch_size {tbs} is not divisible by accum {gas} x "
                                      f"{why} = {gas * world}", f"use a multiple of {gas * world}"))
        else:
            f.fill("train_micro_batch_size_per_gpu", tbs // (gas * world), f"batch {tbs} / (accum {gas} x {why})")
    elif not isinstance(gas, int):
        if tbs % (micro * world):
            f.problems.append(Problem("train_batch_size", f"train_batch_size {tbs} is not divisible by micro {micro} x "
                                      f"{why} = {micro * world}", f"use a multiple of {micro * world}"))
        else:
            f.fill("gradient_accumulation_steps", tbs // (micro * world), f"batch {tbs} / (micro {micro} x {why})")


def _resolve_settings(f: _Filler, ctx: Context) -> None:
    r = ctx.recipe
    settings = {
        "gradient_clipping": (r["gradient_clipping"], "recipe gradient_clipping"),
        "optimizer.params.lr": (r["optimizer"]["lr"], "recipe optimizer.lr"),
        "optimizer.params.betas": (list(r["optimizer"]["betas"]), "recipe optimizer.betas"),
        "optimizer.params.eps": (r["optimizer"]["eps"], "recipe optimizer.eps"),
        "optimizer.params.weight_decay": (r["optimizer"]["weight_decay"], "recipe optimizer.weight_decay"),
        "scheduler.params.warmup_min_lr": (0.0, "default 0"),
        "scheduler.params.warmup_max_lr": (r["optimizer"]["lr"], "recipe optimizer.lr"),
        "scheduler.params.warmup_num_steps": (r["scheduler"]["warmup_steps"], "recipe scheduler.warmup_steps"),
        "scheduler.params.total_num_steps": (schedule_total(r["train"]["steps"]), "recipe train.steps + 1"),
        "fp16.enabled": (r["precision"] == "fp16", f"recipe precision {r['precision']!r}"),
        "bf16.enabled": (r["precision"] == "bf16", f"recipe precision {r['precision']!r}"),
        # accelerate's _prepare_deepspeed: False unless its plugin sets zero3_save_16bit_model; the harness
        # exports full weights itself (harness export), so it does not need DeepSpeed's 16-bit gather
        "zero_optimization.stage3_gather_16bit_weights_on_model_save": (False, "accelerate's default"),
    }
    for path, (value, source) in settings.items():
        if get_path(f.ds, path) == "auto":
            f.fill(path, value, source)


def _resolve_buckets(f: _Filler, ctx: Context) -> None:
    hidden = (ctx.model or {}).get("hidden_size")
    for key, (formula, text) in MODEL_SIZED_BUCKETS.items():
        path = f"zero_optimization.{key}"
        if get_path(f.ds, path) != "auto":
            continue
        if hidden:
            f.fill(path, formula(hidden), f"model {ctx.model_name} hidden_size={hidden}: {text}")
        else:  # the HF integration fills it from the model at launch; nothing to refuse
            f.problems.append(Problem(path, f'"auto" is filled from the model\'s hidden_size ({text}) at launch; '
                                      "no model is known here", "pass --model to see the value", severity="note"))


def resolve(ds: dict, ctx: Context) -> tuple[dict, dict[str, dict], list[Problem]]:
    """Return (resolved copy, provenance {path: {value, source}}, problems)."""
    f = _Filler(copy.deepcopy(ds))
    pp, tp = degrees(ds, ctx.recipe)
    _resolve_batch(f, ctx, pp, tp)
    _resolve_settings(f, ctx)
    _resolve_buckets(f, ctx)
    return f.ds, f.provenance, f.problems


def render_provenance(provenance: dict[str, dict]) -> str:
    if not provenance:
        return "filled values: none (no \"auto\" in this config)"
    width = max(len(p) for p in provenance)
    lines = ["filled values:"]
    for path, item in provenance.items():
        lines.append(f"  {path:<{width}} = {json.dumps(item['value']):<12} <- {item['source']}")
    return "\n".join(lines)
