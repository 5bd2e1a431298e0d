"""The step time the planner predicts for this very run (planner/steptime.py), on the hardware profile of the
machine it runs on (planner/hardware.for_machine: $HARNESS_HARDWARE, the `harness calibrate` file, or the named
profile of this GPU). Inputs are read off the resolved DeepSpeed config and the model's config, so a gap
between predicted and measured is a gap in the time model, not in its inputs."""

from __future__ import annotations

import os


def _model_cfg(spec, engine) -> dict:
    config = getattr(getattr(engine, "module", None), "config", None)
    if config is not None and hasattr(config, "to_dict"):
        return config.to_dict()
    from harness.model_shapes import load_model_config

    return load_model_config(spec.recipe["train"]["model"])


def _candidate(spec):
    from harness.planner import layouts

    zero = spec.ds_config.get("zero_optimization", {})
    stage = zero.get("stage", 0)
    opt = (zero.get("offload_optimizer") or {}).get("device", "none")
    par = (zero.get("offload_param") or {}).get("device", "none")
    if stage < 3:
        opt = "cpu" if opt == "nvme" else opt  # stages 1-2 treat nvme as cpu (deepspeed-facts.md)
    recipe = "3d" if spec.pp > 1 and spec.tp > 1 else "pipeline" if spec.pp > 1 else "tp" if spec.tp > 1 else "zero"
    from harness.profiling.predict import long_context

    seq = long_context(spec.recipe)
    act = "offload" if seq["offload"] else ""  # tiling alone keeps the recipe's checkpointing
    autoep = spec.ds_config.get("expert_parallel") or {}
    ep = int(autoep.get("autoep_size", 1)) if autoep.get("enabled") else 1  # MoE: DeepSpeed AutoEP (planner/moe.py)
    return layouts.Candidate(recipe, stage, opt, par, spec.tp, spec.pp, seq["sp"], seq["tiled_mlp"], act, ep)


def for_run(spec, engine, device: str, device_name: str, device_mem_bytes: int) -> dict:
    """{"step_time_s", "breakdown", "profile", "profile_source", ...} or {"note": why not predicted}."""
    from harness.planner import hardware, layouts, steptime
    from harness.planner.params import count_params, model_shape
    from harness.profiling.predict import long_context

    try:
        profile, source = hardware.for_machine(str(device), device_name, device_mem_bytes)
        if profile is None:
            return {"note": source}
        ds, recipe = spec.ds_config, spec.recipe
        cfg = _model_cfg(spec, engine)
        count, shape = count_params(cfg), model_shape(cfg)
        local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or spec.world_size)
        hw = layouts.hardware(local, max(1, spec.world_size // local), device_mem_bytes, None, None)
        micro, accum = ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]
        work = {"seq_len": recipe["train"]["seq_len"], "micro_batch": micro, "grad_accum": accum,
                "precision": recipe["precision"], "global_batch": micro * accum * spec.dp,
                "activation_checkpointing": bool(recipe.get("activation_checkpointing")),
                "attention": long_context(recipe)["attention"], "tile_tokens": long_context(recipe)["tile_tokens"]}
        c = _candidate(spec)
        result = layouts.evaluate(c, count, shape, hw, work)
        t = steptime.step_time(c, count, shape, profile, hw, work, result)
        return {"step_time_s": t["step_time_s"], "breakdown": t["breakdown"], "tokens_per_s": t["tokens_per_s"],
                "per_stage": t["per_stage"],
                "mfu": t["mfu"], "profile": profile["name"], "profile_source": source,
                "layout": {"zero": c.stage, "offload_optimizer": c.offload_optimizer, "offload_param": c.offload_param,
                           "tp": c.tp, "pp": c.pp, "dp": spec.dp, "micro_batch": micro, "grad_accum": accum}}
    except Exception as e:  # a run must never fail because its prediction cannot be made
        return {"note": f"step time not predicted: {type(e).__name__}: {e}"}
