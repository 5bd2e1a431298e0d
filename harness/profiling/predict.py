"""What the planner predicts for this very run: model-state bytes per rank, activations, comm bytes per step.

Inputs are read off the live engine and the resolved DeepSpeed config, not re-derived from the recipe:
the parameters this rank's ZeRO group holds (ds_numel, after any tensor-parallel split), which ZeRO-3
parameters DeepSpeed marked persistent (ds_persist), the bucket sizes actually configured. So a gap
between predicted and measured is a gap in the planner's model, not in its inputs.
"""

from __future__ import annotations

from types import SimpleNamespace

from harness.config.defaults import STAGE3_MAX_LIVE_PARAMETERS, TILE_TOKENS
from harness.errors import UsageError
from harness.planner import comm, memory, moe, pipeline, sequence


def live_count(module, optimizer=None) -> dict:
    """Per-rank parameter facts from the live module (ZeRO-3 partitioned parameters report ds_numel) and, for
    ZeRO-1/2, the parameters overlapping this rank's partition (whole tensors: params_in_partition)."""
    params = list(module.parameters())
    numel = [getattr(p, "ds_numel", p.numel()) for p in params]
    own = [sum(getattr(p, "ds_numel", p.numel()) for p in m.parameters(recurse=False)) for m in module.modules()]
    in_partition = getattr(optimizer, "params_in_partition", None)
    trainable = [n for p, n in zip(params, numel) if p.requires_grad]
    own_trainable = [sum(getattr(p, "ds_numel", p.numel()) for p in m.parameters(recurse=False) if p.requires_grad)
                     for m in module.modules()]
    frozen = len(trainable) < len(params)  # LoRA: only the adapters have gradients and optimizer state
    return {"total": sum(numel), "largest_layer": max(own, default=0), "largest_tensor": max(numel, default=0),
            "persistent": sum(n for p, n in zip(params, numel) if getattr(p, "ds_persist", False)),
            "partition_whole": sum(p.numel() for group in in_partition for p in group) if in_partition else None,
            "trainable": sum(trainable) if frozen else None,
            "largest_trainable_tensor": max(trainable, default=0) if frozen else None,
            "largest_trainable_layer": max(own_trainable, default=0) if frozen else None,
            "experts": sum(n for p, n in zip(params, numel) if _is_expert(p))}


def _is_expert(param) -> bool:
    """A DeepSpeed AutoEP expert tensor (this rank's experts; module_inject/auto_ep_layer.py marks them
    allreduce=False, reduced over the expert-data-parallel group)."""
    return getattr(param, "allreduce", True) is False or getattr(param, "ds_zero_placement_family", "") == \
        "autoep_expert"


def _zero_settings(ds: dict) -> dict:
    zo = ds.get("zero_optimization", {})
    stage = zo.get("stage", 0)
    opt_dev = (zo.get("offload_optimizer") or {}).get("device", "none") if stage >= 1 else "none"
    param_dev = (zo.get("offload_param") or {}).get("device", "none") if stage == 3 else "none"
    defaults = memory.ZeroBuckets()
    opt_block, param_block = zo.get("offload_optimizer") or {}, zo.get("offload_param") or {}
    buckets = memory.ZeroBuckets(
        reduce_bucket_elems=int(zo.get("reduce_bucket_size", defaults.reduce_bucket_elems)),
        prefetch_bucket_elems=int(zo.get("stage3_prefetch_bucket_size", defaults.prefetch_bucket_elems)),
        param_persistence_threshold=int(zo.get("stage3_param_persistence_threshold",
                                               defaults.param_persistence_threshold)),
        sub_group_elems=int(zo.get("sub_group_size", defaults.sub_group_elems)),
        overlap_comm=zo.get("overlap_comm"),
        optimizer_swap_buffer_count=int(opt_block.get("buffer_count", defaults.optimizer_swap_buffer_count)),
        param_swap_buffer_count=int(param_block.get("buffer_count", defaults.param_swap_buffer_count)),
        param_swap_buffer_elems=int(param_block.get("buffer_size", defaults.param_swap_buffer_elems)),
        max_reuse_distance_elems=int(zo.get("stage3_max_reuse_distance", defaults.max_reuse_distance_elems)))
    return {"stage": stage, "offload_optimizer": opt_dev, "offload_param": param_dev, "buckets": buckets,
            "max_live": int(zo.get("stage3_max_live_parameters", STAGE3_MAX_LIVE_PARAMETERS))}


def _model_shape(module) -> dict | None:
    from harness.planner.params import model_shape

    config = getattr(module, "config", None)
    try:
        return model_shape(config.to_dict()) if config is not None else None
    except Exception:  # an architecture the planner cannot size: predictions without activations
        return None


def gathers_per_micro_step(stage: int, gathered_params: int, max_live: int) -> int:
    """ZeRO-3 re-gathers parameters in backward only when it had to release them after forward: when the
    gathered parameters exceed stage3_max_live_parameters (measured: a small model gathers once)."""
    return comm.zero3_gathers(gathered_params, max_live) if stage == 3 else 2


def long_context(recipe: dict) -> dict:
    """The long-context settings of a recipe (sp-core's keys, issue #24; absent before them: sp 1, no tiling) as
    memory.activation_bytes' arguments."""
    train = recipe.get("train", {})
    attention = str(train.get("attention") or "auto").lower()  # auto on CPU: sdpa, document_sdpa under SP
    kind = next((k for k in ("flash", "flex", "eager") if k in attention), "sdpa")
    sp = int(recipe.get("parallel", {}).get("sequence") or 1)
    if kind == "sdpa" and sp == 1 and train.get("packing", "document") == "concat":
        # concat rows carry no position ids: transformers' sdpa runs is_causal without a mask (torch's flash
        # kernel), so neither the s^2 bool mask nor its float copy exists: the activation model's "flash" terms
        # (measured, bench/long_context.py: the s^2 terms made the planner's longest 6,211 where 8,192 fit)
        kind = "flash"
    return {"sp": sp, "tiled_mlp": bool(train.get("tiled_mlp")),
            "tiled_loss": bool(train.get("tiled_loss")), "attention": kind,
            "offload": bool(train.get("activation_offload")),
            "tile_tokens": int(train.get("tile_tokens") or TILE_TOKENS)}


def predict(count: dict, ds: dict, *, dp: int, precision: str, shape: dict | None, seq_len: int,
            tp: int = 1, activation_checkpointing: bool = False, seq: dict | None = None) -> dict:
    """Predicted model states (after a step and at peak), activations and logged comm bytes per step. `seq`:
    long_context(recipe) (Ulysses sp, tiling, attention, activation offload); the sp group's all-to-alls join
    the comm bytes (planner/sequence.py), so the report puts them beside what the comms logger measured."""
    seq = seq or {}
    z = _zero_settings(ds)
    grad_accum = int(ds.get("gradient_accumulation_steps", 1))
    micro = int(ds.get("train_micro_batch_size_per_gpu", 1))
    notes = []
    common = dict(dp=dp, precision=precision, offload_optimizer=z["offload_optimizer"],
                  largest_layer_params=count["largest_layer"], largest_tensor_params=count["largest_tensor"],
                  buckets=z["buckets"], grad_accum=grad_accum, accum_elems=count.get("partition_whole"),
                  trainable_params=count.get("trainable"), largest_trainable_tensor=count.get("largest_trainable_tensor"),
                  largest_trainable_layer=count.get("largest_trainable_layer"))

    from harness.checkpoint.save import expert_degree

    ep, experts = expert_degree(ds), count.get("experts", 0)

    def states(stage: int, phase: str) -> dict:
        kw = dict(stage=stage, phase=phase, offload_param=z["offload_param"] if stage == 3 else "none",
                  persistent_params=count["persistent"] if stage == 3 else 0, **common)
        if ep > 1 and experts:  # AutoEP: this rank's experts shard over dp / ep ranks (planner/moe.py)
            return moe.model_state_bytes(SimpleNamespace(total=count["total"] - experts + experts * ep,
                                                         routed_experts=experts * ep), ep=ep, **kw)
        return memory.model_state_bytes(count["total"], **kw)

    out: dict = {"params_per_rank": count["total"], "dp": dp, "stage": z["stage"],
                 "after_step": states(z["stage"], "after_step"), "peak": states(z["stage"], "peak")}
    out["after_step_by_stage"] = {str(s): sum(memory.by_device(states(s, "after_step")).values()) for s in range(4)}
    gathers = gathers_per_micro_step(z["stage"], count["total"] - count["persistent"], z["max_live"])
    out["comm"] = comm.comm_bytes_per_step(count["total"], stage=z["stage"], dp=dp, precision=precision,
                                           grad_accum=grad_accum, persistent_params=count["persistent"],
                                           gathers_per_micro_step=gathers, trainable_params=count.get("trainable"))
    if ep > 1 and experts:
        notes.append(f"expert parallel {ep}: {experts:,} expert parameters on this rank shard over {max(1, dp // ep)}"
                     " expert-data-parallel ranks (model states); the comm bytes count them over dp")
    if z["stage"] == 3:
        notes.append(f"ZeRO-3 all-gathers parameters {gathers}x per micro-step "
                     f"({count['total'] - count['persistent']:,} gathered params vs "
                     f"stage3_max_live_parameters {z['max_live']:,})")
    if shape is not None:
        acts = memory.activation_bytes(shape, seq_len=seq_len, micro_batch=micro, precision=precision,
                                       activation_checkpointing=activation_checkpointing, tp=tp, **seq)
        out["comm"].update(sequence.a2a_bytes_per_step(
            shape, seq_len=seq_len, micro_batch=micro, micro_batches=grad_accum, sp=seq.get("sp", 1),
            blocks=shape["num_hidden_layers"], precision=precision, activation_checkpointing=activation_checkpointing))
        out["activations"] = acts
        out["peak_total_bytes"] = memory.training_peak(lambda phase: states(z["stage"], phase), acts["total"])
        if tp > 1:
            tp_comm = pipeline.tp_allreduce_bytes(shape, tp=tp, blocks=shape["num_hidden_layers"], seq_len=seq_len,
                                                  micro_batch=micro, micro_batches=grad_accum, precision=precision,
                                                  activation_checkpointing=activation_checkpointing)
            out["comm"]["all_reduce"] = out["comm"].get("all_reduce", 0) + tp_comm
    else:
        notes.append("activations not predicted: the planner cannot size this architecture")
    out["notes"] = notes
    return out


def for_run(spec, engine) -> dict:
    """Predictions for this launch; {"error": ...} rather than a crash when the planner cannot answer."""
    train = spec.recipe["train"]
    try:
        if getattr(spec, "pp", 1) > 1:
            from harness.profiling.predict_pipe import for_pipeline

            return for_pipeline(spec, engine, _zero_settings(spec.ds_config), live_count(engine.module))
        # ZeRO shards over the data-parallel AND sequence-parallel ranks (spec.dp counts replicas: world / sp)
        zero_dp = spec.dp * getattr(spec, "sp", 1)
        return predict(live_count(engine.module, engine.optimizer), spec.ds_config, dp=zero_dp,
                       precision=spec.recipe["precision"], shape=_model_shape(engine.module),
                       seq_len=train["seq_len"], tp=spec.tp,
                       activation_checkpointing=bool(spec.recipe.get("activation_checkpointing")),
                       seq=long_context(spec.recipe))
    except (ValueError, KeyError, TypeError, UsageError) as e:
        return {"error": f"planner could not predict this run: {e}"}
