"""The planner's prediction for one rank of a pipeline (or 3D) run, to set beside what the hooks measure.

Unlike predict.py, the parameters a rank holds are NOT read off the engine: they come from the model's shape
through the planner's own copy of DeepSpeed's layer partitioning (planner/pipeline.py), so a comparison with
the live count tests the planner's stage split, tied-embedding copies and tensor-parallel split. Only what the
planner cannot know is read from the run: this rank's stage, the partition method and micro-batching from the
DeepSpeed config, the ZeRO buckets, and the engine's own partition (recorded beside the planned one).
"""

from __future__ import annotations

from harness.planner import comm, memory, pipeline
from harness.planner.params import count_params, model_shape, with_lora


def _hf_config(module, spec) -> dict:
    config = getattr(module, "config", None) or getattr(module, "hf_config", None)
    if config is not None:
        return config if isinstance(config, dict) else config.to_dict()
    from harness.model_shapes import load_model_config

    return load_model_config(spec.recipe["train"]["model"])


def dp_comm(stage_params: int, *, zero_stage: int, dp: int, precision: str, grad_accum: int,
            trainable_params: int | None = None) -> dict:
    """The data-parallel gradient traffic of one stage (logged bytes: a group of one included). A pipeline
    reduces at the step boundary only."""
    return comm.comm_bytes_per_step(stage_params, stage=zero_stage, dp=dp, precision=precision,
                                    grad_accum=1 if zero_stage <= 1 else grad_accum, trainable_params=trainable_params)


def _count(cfg: dict, adapter: dict | None):
    """The model's count, with the recipe's LoRA adapters when it has them."""
    count = count_params(cfg)
    if adapter and adapter.get("type") == "lora":
        count = with_lora(count, cfg, adapter["r"], adapter["target_modules"])
    return count


def _add(total: dict, part: dict) -> None:
    for op, nbytes in part.items():
        if nbytes:
            total[op] = total.get(op, 0) + int(nbytes)


def predict_rank(cfg: dict, ds: dict, *, stage: int, pp: int, tp: int, dp: int, precision: str, seq_len: int,
                 zero: dict, largest_tensor: int, activation_checkpointing: bool = False,
                 bf16_optimizer: bool = False, counted_tp: int | None = None, adapter: dict | None = None,
                 packing: str = "document") -> dict:
    """Model states (no activations) and logged comm bytes per step for one rank of `stage` (adapter: the recipe's
    LoRA block, whose adapters are then all that trains)."""
    count = _count(cfg, adapter)
    shape = model_shape(cfg)
    pipe = ds.get("pipeline") or {}
    method = pipe.get("partition", "parameters")
    micro, m = int(ds.get("train_micro_batch_size_per_gpu", 1)), int(ds.get("gradient_accumulation_steps", 1))
    plan = pipeline.stages(count, pp, method, tp, counted_tp)
    mine = plan[stage]
    trainable = count.trainable_params(mine["blocks"], tp)
    lora = {} if trainable is None else {"trainable_params": trainable,
                                         "largest_trainable_tensor": count.lora_largest_tensor}
    states = {phase: memory.model_state_bytes(
        mine["params"], stage=zero["stage"], dp=dp, precision=precision, offload_optimizer=zero["offload_optimizer"],
        largest_tensor_params=largest_tensor, buckets=zero["buckets"], grad_accum=m, phase=phase, **lora)
        for phase in memory.PHASES}
    groups = {"dp": dp_comm(mine["params"], zero_stage=zero["stage"], dp=dp, precision=precision, grad_accum=m,
                            trainable_params=trainable),
              "pp": pipeline.p2p_bytes(shape, stage=stage, pp=pp, seq_len=seq_len, micro_batch=micro,
                                       micro_batches=m, precision=precision, tp=tp,
                                       partitioned=bool(pipe.get("pipe_partitioned", True)),
                                       position_ids=packing == "document"),
              "tp": {"all_reduce": pipeline.tp_allreduce_bytes(
                  shape, tp=tp, blocks=mine["blocks"], seq_len=seq_len, micro_batch=micro, micro_batches=m,
                  precision=precision, activation_checkpointing=activation_checkpointing)},
              "tied": {"all_reduce": 0 if trainable is not None else pipeline.tied_allreduce_bytes(
                  count, stage=stage, pp=pp, precision=precision, bf16_optimizer=bf16_optimizer)}}  # frozen: no grad
    total: dict = {}
    for part in groups.values():
        _add(total, part)
    # 1F1B: stage s holds min(pp - s, m) micro-batches' activations; the last stage computes the logits
    acts = memory.activation_bytes(shape, seq_len=seq_len, micro_batch=micro, precision=precision,
                                   activation_checkpointing=activation_checkpointing, tp=tp,
                                   num_layers=mine["blocks"], micro_batches_in_flight=min(pp - stage, m),
                                   with_logits=stage == pp - 1)
    return {"activations": acts, "peak_total_bytes": memory.training_peak(states.get, acts["total"]),
            "params_per_rank": mine["params"], "dp": dp, "tp": tp, "pp": pp, "stage": zero["stage"],
            "pipe_stage": stage, "partition_method": method,
            "parts_planned": pipeline.partition(count, pp, method, tp, counted_tp),
            "stage_layers": mine["names"], "micro_batches": m,
            "bubble_fraction": pipeline.bubble_fraction(pp, m),
            "after_step": states["after_step"], "peak": states["peak"], "comm": total,
            "comm_by_group": {g: {op: n for op, n in part.items() if n} for g, part in groups.items()},
            "notes": [f"pipeline: stage {stage} of {pp} holds layers {mine['layers'][0]}..{mine['layers'][1] - 1} "
                      f"({', '.join(mine['names'])}) by partition_method {method}"]}


def _counted_tp(cfg: dict, ds: dict, pp: int, tp: int, parts: list[int], adapter: dict | None = None) -> int:
    """Which block split DeepSpeed weighed when it partitioned (split after the build: 1, the harness; split
    as built: tp), told by the engine's own partition; 1 when both agree or neither matches (notes say so)."""
    if tp <= 1 or not parts:
        return 1
    count = _count(cfg, adapter)
    method = (ds.get("pipeline") or {}).get("partition", "parameters")
    if pipeline.partition(count, pp, method, tp, 1) != parts and pipeline.partition(count, pp, method, tp, tp) == parts:
        return tp
    return 1


def for_pipeline(spec, engine, zero: dict, live: dict) -> dict:
    """predict_rank with this rank's facts read off the PipelineEngine; the engine's partition beside it."""
    cfg = _hf_config(engine.module, spec)
    parts = [int(p) for p in getattr(engine.module, "parts", [])]
    out = predict_rank(cfg, spec.ds_config, stage=engine.stage_id, pp=spec.pp, tp=spec.tp, dp=spec.dp,
                       precision=spec.recipe["precision"], seq_len=spec.recipe["train"]["seq_len"], zero=zero,
                       largest_tensor=live["largest_tensor"],
                       activation_checkpointing=bool(spec.recipe.get("activation_checkpointing")),
                       bf16_optimizer=type(engine.optimizer).__name__ == "BF16_Optimizer",
                       counted_tp=_counted_tp(cfg, spec.ds_config, spec.pp, spec.tp, parts, spec.recipe.get("adapter")),
                       adapter=spec.recipe.get("adapter"), packing=spec.recipe["train"].get("packing", "document"))
    out["parts_engine"] = parts
    if parts and parts != out["parts_planned"]:
        out["notes"].append(f"the engine split the layers {parts}, the planner {out['parts_planned']}: "
                            "the planner's layer list differs from the PipelineModule's")
    if live["total"] != out["params_per_rank"]:
        out["notes"].append(f"this rank holds {live['total']:,} parameters, the planner says {out['params_per_rank']:,}")
    return out
