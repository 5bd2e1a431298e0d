"""Recipe -> DeepSpeed config dict. Pure: no torch, no process group, no I/O.

The output is world-size independent: values that depend on the world size or the model are left
as "auto" and filled by harness.config.resolve at launch (with the source of each value recorded).
Nothing in the recipe is dropped here, even when DeepSpeed would ignore it, so the rules layer can
report it.
"""

from __future__ import annotations

from harness.config.defaults import ds_default
from harness.config.recipes import deep_merge

SCHEMA_REF = "../harness/schemas/ds_config.schema.json"
STEPS_PER_PRINT = 100_000  # the harness logs progress itself; keep DeepSpeed's own step lines quiet

OPTIMIZER_NAMES = {"adamw": "AdamW", "adam": "Adam", "lamb": "Lamb", "lion": "Lion", "adagrad": "Adagrad",
                   "muon": "Muon"}
# DeepSpeed's own defaults, written out in an fp16 / NVMe recipe's DeepSpeed dict so a reader sees them
FP16_DEFAULTS = {k: ds_default(f"fp16.{k}") for k in ("loss_scale", "initial_scale_power", "loss_scale_window",
                                                       "hysteresis", "min_loss_scale")}
AIO_DEFAULTS = {k: ds_default(f"aio.{k}") for k in ("block_size", "queue_depth", "single_submit", "overlap_events",
                                                     "intra_op_parallelism")}

# Where each DeepSpeed key comes from in a recipe, so problems found on the DeepSpeed dict can name
# the recipe key the user actually wrote.
RECIPE_SOURCE = {
    "train_batch_size": "batch.train_batch_size",
    "train_micro_batch_size_per_gpu": "batch.micro_batch_per_gpu",
    "gradient_accumulation_steps": "batch.grad_accum_steps",
    "gradient_clipping": "gradient_clipping",
    "fp16.enabled": "precision",
    "bf16.enabled": "precision",
    "zero_optimization.stage": "zero.stage",
    "zero_optimization.offload_optimizer": "zero.offload_optimizer",
    "zero_optimization.offload_optimizer.device": "zero.offload_optimizer",
    "zero_optimization.offload_optimizer.nvme_path": "zero.nvme_path",
    "zero_optimization.offload_param": "zero.offload_param",
    "zero_optimization.offload_param.device": "zero.offload_param",
    "zero_optimization.offload_param.nvme_path": "zero.nvme_path",
    "bf16.bf16_master_weights_and_grads": "optimizer.master_dtype",
    "bf16.bf16_optimizer_states": "optimizer.state_dtype",
    "zero_allow_untested_optimizer": "optimizer.stochastic_rounding",
    "zero_optimization.reduce_scatter": "optimizer.type",
    "pipeline.stages": "parallel.pipeline",
    "sequence_parallel_size": "parallel.sequence",
    "seq_parallel_communication_data_type": "parallel.sequence_comm_dtype",
    "expert_parallel.autoep_size": "parallel.expert",
}


def _optimizer(recipe: dict) -> dict:
    opt = recipe["optimizer"]
    if opt["type"] == "sgd":  # torch.optim.SGD built by DeepSpeed from its name: plain steps, no momentum
        return {"type": "SGD", "params": {"lr": opt["lr"], "momentum": 0.0, "weight_decay": opt["weight_decay"]}}
    params = {"lr": opt["lr"], "betas": list(opt["betas"]), "eps": opt["eps"], "weight_decay": opt["weight_decay"]}
    if opt["type"] == "muon":  # deepspeed engine._muon_param_groups: momentum for the Muon half, betas/eps for AdamW
        params.update(momentum=opt["momentum"], muon_lr=muon_lrs(recipe)[0], adam_lr=muon_lrs(recipe)[1])
    return {"type": OPTIMIZER_NAMES[opt["type"]], "params": params}


def muon_lrs(recipe: dict) -> tuple[float, float]:
    """(Muon lr, AdamW lr) of a muon recipe: optimizer.muon_lr / adam_lr, each optimizer.lr when null. DeepSpeed
    builds the groups [Muon parameters, AdamW parameters] in that order (engine._muon_param_groups), so a scheduler
    ramps each to its own peak (warmup_max_lr as a list)."""
    opt = recipe["optimizer"]
    return (opt["muon_lr"] or opt["lr"], opt["adam_lr"] or opt["lr"])


def schedule_total(steps: int) -> int:
    """DeepSpeed's total_num_steps for a run of `steps` steps. The harness trains step k at the scheduler's iteration
    k (harness/train/schedule.py), so a schedule ending at total_num_steps would train the last step at its end
    value (WarmupDecayLR: lr 0, a step that changes nothing); it ends one step after the last instead."""
    return steps + 1


def _scheduler(recipe: dict) -> dict | None:
    sched, lr, steps = recipe["scheduler"], recipe["optimizer"]["lr"], recipe["train"]["steps"]
    warmup = min(sched["warmup_steps"], steps)  # a short run (--set train.steps=5) warms up for all of it
    if sched["type"] == "none":
        return None
    if sched["type"] == "WarmupCosineLR":  # linear warmup like the others (DeepSpeed's default here is log)
        return {"type": "WarmupCosineLR",
                "params": {"total_num_steps": schedule_total(steps), "warmup_num_steps": warmup,
                           "warmup_type": "linear", "warmup_min_ratio": 0.0,
                           "cos_min_ratio": 0.1}}
    adapter = recipe["adapter"]
    if adapter["type"] == "lora" and adapter["lr_B_ratio"]:  # LoRA+: groups [A and the rest, B]
        lr = [lr, lr * adapter["lr_B_ratio"]]
    elif recipe["optimizer"]["type"] == "muon":
        lr = list(muon_lrs(recipe))
    params = {"warmup_min_lr": 0.0, "warmup_max_lr": lr, "warmup_num_steps": warmup, "warmup_type": "linear"}
    if sched["type"] == "WarmupDecayLR":
        params["total_num_steps"] = schedule_total(steps)
    return {"type": sched["type"], "params": params}


def _offload(device: str, nvme_path: str | None) -> dict:
    block: dict = {"device": device, "pin_memory": True}
    if device == "nvme":
        block["nvme_path"] = nvme_path
    return block


def _zero(recipe: dict) -> dict:
    z = recipe["zero"]
    out: dict = {"stage": z["stage"]}
    if z["stage"] >= 1:
        out.update(overlap_comm=z["overlap_comm"], contiguous_gradients=z["contiguous_gradients"],
                   reduce_bucket_size=z["reduce_bucket_size"])
    if z["stage"] in (1, 2):
        out["allgather_bucket_size"] = z["allgather_bucket_size"]
    if z["stage"] == 3 and recipe["optimizer"]["type"] == "muon":  # stage3.py: "Muon and reduce scatter cannot
        out["reduce_scatter"] = False  # be used together" (its default is true): Muon needs each whole gradient
    if z["stage"] == 3:
        out.update(stage3_prefetch_bucket_size=z["stage3_prefetch_bucket_size"],
                   stage3_param_persistence_threshold=z["stage3_param_persistence_threshold"],
                   stage3_max_live_parameters=z["stage3_max_live_parameters"],
                   stage3_gather_16bit_weights_on_model_save=z["stage3_gather_16bit_weights_on_model_save"])
    # Emitted even where DeepSpeed would ignore them (stage < 3, stage 0), so validation reports it.
    if z["offload_optimizer"] != "none":
        out["offload_optimizer"] = _offload(z["offload_optimizer"], z["nvme_path"])
    if z["offload_param"] != "none":
        out["offload_param"] = _offload(z["offload_param"], z["nvme_path"])
    return out


def _low_precision_states(recipe: dict, bf16: dict | None) -> dict:
    """optimizer.master_dtype / state_dtype -> DeepSpeed's bf16 block flags. Written into the bf16 block even when
    the recipe trains in another precision, so the rules layer can say why that is refused."""
    opt = recipe["optimizer"]
    flags = {"bf16_master_weights_and_grads": opt["master_dtype"] == "bf16",
             "bf16_optimizer_states": opt["state_dtype"] == "bf16"}
    if not any(flags.values()):
        return {}
    return {"bf16": {**(bf16 or {"enabled": False}), **{k: v for k, v in flags.items() if v}}}


def build(recipe: dict) -> dict:
    """A complete recipe (defaults filled) -> DeepSpeed config dict."""
    batch = recipe["batch"]
    ds: dict = {
        "$schema": SCHEMA_REF,
        "train_batch_size": batch["train_batch_size"],
        "train_micro_batch_size_per_gpu": batch["micro_batch_per_gpu"],
        "gradient_accumulation_steps": batch["grad_accum_steps"],
        "steps_per_print": STEPS_PER_PRINT,
        "gradient_clipping": recipe["gradient_clipping"],
        "optimizer": _optimizer(recipe),
    }
    if recipe["optimizer"]["type"] == "sgd" or recipe["optimizer"]["stochastic_rounding"]:
        ds["zero_allow_untested_optimizer"] = True  # outside ZeRO's tested list; torchao's _AdamW is a client optimizer
    scheduler = _scheduler(recipe)
    if scheduler:
        ds["scheduler"] = scheduler
    if recipe["precision"] == "bf16":
        ds["bf16"] = {"enabled": True}
    elif recipe["precision"] == "fp16":
        ds["fp16"] = {"enabled": True, **FP16_DEFAULTS}
    ds.update(_low_precision_states(recipe, ds.get("bf16")))
    ds["zero_optimization"] = _zero(recipe)
    if "nvme" in (recipe["zero"]["offload_optimizer"], recipe["zero"]["offload_param"]):
        ds["aio"] = dict(AIO_DEFAULTS)
    parallel = recipe["parallel"]
    if parallel["pipeline"] > 1:
        ds["pipeline"] = {"stages": parallel["pipeline"], "partition": parallel["partition_method"],
                          "activation_checkpoint_interval": 1 if recipe["activation_checkpointing"] else 0}
    if parallel["expert"] > 1:  # DeepSpeed AutoEP; preset_model and use_grouped_mm are filled at launch
        ds["expert_parallel"] = {"enabled": True, "autoep_size": parallel["expert"]}  # (harness/model/moe/wiring.py)
    # parallel.tensor emits nothing: the runner splits the layers itself (harness/model/parallel/tensor.py,
    # also inside pipeline stages, where DeepSpeed 0.19's AutoTP cannot go) and hands DeepSpeed an mpu.
    if parallel["sequence"] > 1:  # Ulysses: the batch arithmetic counts world / sp data-parallel ranks
        ds["sequence_parallel_size"] = parallel["sequence"]
        if parallel["sequence_comm_dtype"] != "auto":
            ds["seq_parallel_communication_data_type"] = parallel["sequence_comm_dtype"]
    ds["wall_clock_breakdown"] = False
    return deep_merge(ds, recipe["deepspeed"])
