"""Cross-field rules DeepSpeed does not check (or checks late, with an unhelpful message).

Each rule is a small pure function `(ds, ctx) -> list[Problem]`. They run on a DeepSpeed dict
after the schema, so types are mostly right, but every rule still reads defensively: a broken
value elsewhere must not hide this rule's finding.
"""

from __future__ import annotations

import json

from harness.errors import Problem
from harness.model_shapes import PIPELINE_FAMILIES, tp_problems
from harness.config.resolve import BATCH_KEYS, Context, autotp, batch_world, degrees, is_count, sequence_parallel
from harness.config.schema import suggest
from harness.config.adapter_rules import check_adapter
from harness.config import vision_rules
from harness.config.distill_rules import check_distill
from harness.config.preference_rules import check_preference
from harness.config.stream_rules import check_streaming
from harness.config.mixture_rules import check_mixture
from harness.config.rl_rules import check_rl
from harness.config.optimizer_rules import (check_int8_states, check_low_precision_states, check_muon,
                                            check_stochastic_rounding)

# DeepSpeed 0.19.8 runtime/config.py DEEPSPEED_OPTIMIZERS (matched lower-cased) ...
DS_OPTIMIZERS = ("adagrad", "adam", "adamw", "lamb", "muadam", "muadamw", "musgd", "lion", "muon")
# ... and otherwise getattr(torch.optim, type) (matched as written).
TORCH_OPTIMIZERS = ("SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD", "LBFGS", "NAdam", "RAdam",
                    "RMSprop", "Rprop", "SparseAdam", "Adafactor", "Muon")
# runtime/zero/utils.py ZERO_SUPPORTED_OPTIMIZERS, by the name that builds them from a config.
ZERO_TESTED = ("adam", "adamw", "adagrad", "lion", "muon")  # utils.is_zero_supported_optimizer adds MuonWithAuxAdam
# runtime/lr_schedules.py: scheduler -> (accepted params, required params)
SCHEDULERS = {
    "LRRangeTest": ({"lr_range_test_min_lr", "lr_range_test_step_size", "lr_range_test_step_rate",
                     "lr_range_test_staircase"}, set()),
    "OneCycle": ({"cycle_min_lr", "cycle_max_lr", "decay_lr_rate", "cycle_first_step_size", "cycle_second_step_size",
                  "cycle_first_stair_count", "cycle_second_stair_count", "decay_step_size", "cycle_momentum",
                  "cycle_min_mom", "cycle_max_mom", "decay_mom_rate"}, {"cycle_min_lr", "cycle_max_lr"}),
    "WarmupLR": ({"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"}, set()),
    "WarmupDecayLR": ({"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "total_num_steps"},
                      {"total_num_steps"}),
    "WarmupCosineLR": ({"total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type"},
                       {"total_num_steps"}),
}


def _block(ds: dict, key: str) -> dict:
    value = ds.get(key)
    return value if isinstance(value, dict) else {}


def _enabled(ds: dict, key: str) -> bool:
    return _block(ds, key).get("enabled") is True


def check_precision(ds: dict, ctx: Context) -> list[Problem]:
    out = []
    if _enabled(ds, "fp16") and _enabled(ds, "bf16"):
        out.append(Problem("fp16.enabled", "fp16 and bf16 are both enabled (DeepSpeed asserts at start-up)",
                           "enable one: bf16 on Ampere or newer GPUs and on CPU, fp16 on older GPUs"))
    if _enabled(ds, "fp16") and ctx.fp16_supported is False:
        out.append(Problem("fp16.enabled", "fp16 is not supported on this device (DeepSpeed: 'Type fp16 is not "
                           "supported on your device'; CPU has no fp16 training)",
                           "use precision bf16 or fp32 here (--set precision=bf16); keep fp16 for GPU nodes"))
    return out


def check_offload(ds: dict, ctx: Context) -> list[Problem]:
    zero = _block(ds, "zero_optimization")
    stage = zero.get("stage", 0) if isinstance(zero.get("stage", 0), int) else 0
    out = []
    for name in ("offload_optimizer", "offload_param"):
        block = zero.get(name)
        if not isinstance(block, dict):
            continue
        device = block.get("device", "none")
        path = f"zero_optimization.{name}"
        if device == "none":
            continue
        if name == "offload_param" and stage < 3:
            out.append(Problem(path, f"offload_param (device {device!r}) with stage {stage}: DeepSpeed accepts it "
                               "and silently keeps parameters on the GPU", "use stage 3, or remove offload_param"))
        elif name == "offload_optimizer" and stage == 0:
            out.append(Problem(path, f"offload_optimizer (device {device!r}) with stage 0: DeepSpeed silently "
                               "does no offload", "use stage 1 or higher (2 is the usual choice for optimizer offload)"))
        if device == "nvme" and 0 < stage < 3:
            out.append(Problem(f"{path}.device", f"nvme offload with stage {stage}: DeepSpeed silently treats it "
                               "as CPU offload", 'use stage 3 for NVMe (ZeRO-Infinity), or device "cpu"'))
        if device == "nvme" and not block.get("nvme_path"):
            out.append(Problem(f"{path}.nvme_path", "nvme offload without nvme_path (DeepSpeed fails late or, "
                               "below stage 3, never notices)", "set nvme_path to a directory on a local NVMe drive"))
        ratio = block.get("ratio")
        if name == "offload_optimizer" and isinstance(ratio, (int, float)) and ratio < 1 and stage < 3:
            out.append(Problem(f"{path}.ratio", f"ratio {ratio} < 1 (partial optimizer offload) needs stage 3, "
                               f"got stage {stage}", "use stage 3, or set ratio to 1"))
    return out


def check_parallel(ds: dict, ctx: Context) -> list[Problem]:
    pp, tp = degrees(ds, ctx.recipe)
    tp_path = "tensor_parallel.autotp_size" if autotp(ds, ctx.recipe) else "parallel.tensor"
    out = []
    stage = _block(ds, "zero_optimization").get("stage", 0)
    if pp > 1 and stage in (2, 3):
        out.append(Problem("zero_optimization.stage", f"pipeline parallelism ({pp} stages) with ZeRO stage {stage}: "
                           "DeepSpeed refuses ZeRO-2/3 with pipeline parallelism", "use ZeRO stage 0 or 1 with a pipeline"))
    world = ctx.world_size
    if world is not None:
        for name, path, degree in (("pipeline", "pipeline.stages", pp), ("tensor", tp_path, tp)):
            if world % degree:
                out.append(Problem(path, f"{name} degree {degree} does not divide the world size {world}",
                                   f"use a world size that is a multiple of {degree}, or a degree dividing {world}"))
        if world % pp == 0 and world % tp == 0 and world % (pp * tp):
            out.append(Problem("pipeline.stages", f"pipeline {pp} x tensor {tp} = {pp * tp} does not divide the "
                               f"world size {world} ({world} / {pp * tp} = {world / (pp * tp):.3g} data-parallel "
                               "replicas)", f"launch a multiple of {pp * tp} ranks, or make pipeline x tensor "
                               f"divide {world}"))
    if (ctx.model or {}).get("vision"):  # its own reasons, not the causal LM's (config/vision_rules.py)
        found = vision_rules.layout_problems(ctx.model.get("model_type"), {
            "tensor": (tp_path, tp), "pipeline": ("pipeline.stages", pp),
            "sequence": ("sequence_parallel_size", sequence_parallel(ds))})
        return out + [Problem(*p) for p in found]
    out += _pipeline_model(pp, ctx.model or {}, ctx.model_name)
    out += [Problem(tp_path, what, fix) for what, fix in tp_problems(ctx.model or {}, tp, ctx.model_name)]
    return out


def _pipeline_model(pp: int, model: dict, name: str) -> list[Problem]:
    """A pipeline needs a model the harness can cut into stages, and at least one decoder layer per stage."""
    if pp < 2:
        return []
    model_type, layers = model.get("model_type"), model.get("num_hidden_layers")
    if model_type is not None and model_type not in PIPELINE_FAMILIES:
        return [Problem("pipeline.stages", f"model {name} (model_type {model_type!r}) cannot be split into pipeline "
                        f"stages; supported model types: {', '.join(sorted(PIPELINE_FAMILIES))}",
                        "use one of those models, or a recipe without parallel.pipeline")]
    if isinstance(layers, int) and pp > layers:
        return [Problem("pipeline.stages", f"{pp} pipeline stages for the {layers} decoder layers of model {name}: "
                        f"{pp} > {layers} leaves a stage without a decoder layer", f"use at most {layers} stages")]
    return []


def check_batch(ds: dict, ctx: Context) -> list[Problem]:
    vals = [ds.get(k) for k in BATCH_KEYS]
    if ctx.world_size is None or not all(is_count(v) for v in vals):  # 64.0 is a batch size too
        return []
    pp, tp = degrees(ds, ctx.recipe)
    if ctx.world_size % (pp * tp):
        return []  # reported by check_parallel
    world, why = batch_world(ctx.world_size, pp, tp, autotp(ds, ctx.recipe), sequence_parallel(ds))
    tbs, micro, gas = vals
    if tbs != micro * gas * world:
        return [Problem("train_batch_size", f"train_batch_size {tbs} != micro {micro} x accum {gas} x {why} = "
                        f"{micro * gas * world}", 'set train_batch_size to that product, or to "auto"')]
    return []


def check_optimizer(ds: dict, ctx: Context) -> list[Problem]:
    opt = _block(ds, "optimizer")
    name = opt.get("type")
    if not isinstance(name, str):
        return []
    if name.lower() not in DS_OPTIMIZERS and name not in TORCH_OPTIMIZERS:
        hint = suggest(name.lower(), DS_OPTIMIZERS) or suggest(name, TORCH_OPTIMIZERS)
        return [Problem("optimizer.type", f"unknown optimizer {name!r}",
                        hint or f"use one of {', '.join(DS_OPTIMIZERS)} or a torch.optim class name")]
    params = opt.get("params") if isinstance(opt.get("params"), dict) else {}
    if "max_grad_norm" in params:
        return [Problem("optimizer.params.max_grad_norm", "DeepSpeed refuses max_grad_norm as an optimizer parameter "
                        "(ValueError when it builds the optimizer)",
                        f"remove it and set the top-level \"gradient_clipping\": {json.dumps(params['max_grad_norm'])}")]
    stage = _block(ds, "zero_optimization").get("stage", 0)
    if stage and name.lower() not in ZERO_TESTED and ds.get("zero_allow_untested_optimizer") is not True:
        return [Problem("optimizer.type", f"optimizer {name!r} is not in ZeRO's tested list "
                        f"({', '.join(ZERO_TESTED)}); DeepSpeed refuses it with ZeRO stage {stage}",
                        'use adamw, or set "zero_allow_untested_optimizer": true')]
    return []


def check_scheduler(ds: dict, ctx: Context) -> list[Problem]:
    sched = _block(ds, "scheduler")
    name = sched.get("type")
    if not isinstance(name, str):
        return []
    if name not in SCHEDULERS:
        hint = suggest(name, SCHEDULERS)
        return [Problem("scheduler.type", f"unknown scheduler {name!r}", hint or f"use one of {', '.join(SCHEDULERS)}")]
    accepted, required = SCHEDULERS[name]
    params = sched.get("params") if isinstance(sched.get("params"), dict) else {}
    out = [Problem(f"scheduler.params.{k}", f"{name} does not take {k!r}", suggest(k, accepted)
                   or f"{name} takes {', '.join(sorted(accepted))}") for k in params if k not in accepted]
    out += [Problem(f"scheduler.params.{k}", f"{name} requires {k!r}", f"add scheduler.params.{k}")
            for k in sorted(required - set(params))]
    warm = params.get("warmup_num_steps")  # >= 1 is checked by the schema
    lo, hi = params.get("warmup_min_lr"), params.get("warmup_max_lr")
    if isinstance(lo, (int, float)) and isinstance(hi, (int, float)) and lo > hi:
        out.append(Problem("scheduler.params.warmup_min_lr", f"warmup_min_lr {lo} > warmup_max_lr {hi}",
                           "warmup goes from min up to max; swap them"))
    total = params.get("total_num_steps")
    if isinstance(warm, int) and isinstance(total, int) and warm > total:
        out.append(Problem("scheduler.params.warmup_num_steps", f"warmup_num_steps {warm} > total_num_steps {total}",
                           "warm up for fewer steps than the run has"))
    return out


def check_comms_logger(ds: dict, ctx: Context) -> list[Problem]:
    block = ds.get("comms_logger")
    if isinstance(block, dict) and block.get("enabled") is False:
        return [Problem("comms_logger.enabled", "comms_logger is present with enabled=false, but DeepSpeed enables "
                        "it whenever the key exists (every logged collective then blocks)",
                        "remove the comms_logger block to turn it off")]
    return []


RULES = (check_precision, check_offload, check_parallel, check_batch, check_optimizer, check_scheduler,
         check_comms_logger, check_adapter, check_preference, check_streaming, check_mixture, check_rl,
         check_distill, check_low_precision_states, check_muon, check_int8_states, check_stochastic_rounding)


def check(ds: dict, ctx: Context) -> list[Problem]:
    return [p for rule in RULES for p in rule(ds, ctx)]
