"""What the planner predicts for this very run (harness.planner.evaluate), with the facts only the live engine
knows passed in: the parameters this rank's ZeRO group holds (ds_numel, after any tensor-parallel split), which
ZeRO-3 parameters DeepSpeed marked persistent (ds_persist), the tensors overlapping a ZeRO-1/2 partition
(params_in_partition), a pipeline rank's stage and the engine's own partition. So a gap between predicted and
measured is a gap in the planner's model, not in its inputs.
"""

from __future__ import annotations


from harness.config.run_model import RunModel
from harness.errors import UsageError
from harness.planner import evaluate
from harness.planner.prediction import candidate
from harness.planner.rank import LiveFacts


def live_facts(module, optimizer=None, engine=None) -> LiveFacts:
    """Per-rank parameter facts from the live module (ZeRO-3 partitioned parameters report ds_numel) and, for
    ZeRO-1/2, the parameters overlapping this rank's partition (whole tensors: params_in_partition); with a
    PipelineEngine, its stage, partition and optimizer class."""
    params = list(module.parameters())
    numel = [getattr(p, "ds_numel", p.numel()) for p in params]
    own = [sum(getattr(p, "ds_numel", p.numel()) for p in m.parameters(recurse=False)) for m in module.modules()]
    in_partition = getattr(optimizer, "params_in_partition", None)
    trainable = [n for p, n in zip(params, numel) if p.requires_grad]
    own_trainable = [sum(getattr(p, "ds_numel", p.numel()) for p in m.parameters(recurse=False) if p.requires_grad)
                     for m in module.modules()]
    frozen = len(trainable) < len(params)  # LoRA: only the adapters have gradients and optimizer state
    pipe = {}
    if engine is not None:
        pipe = {"pipe_stage": int(getattr(engine, "stage_id", 0)),
                "parts": tuple(int(p) for p in getattr(module, "parts", [])),
                "bf16_optimizer": type(engine.optimizer).__name__ == "BF16_Optimizer"}
    return LiveFacts(
        total=sum(numel), largest_layer=max(own, default=0), largest_tensor=max(numel, default=0),
        persistent=sum(n for p, n in zip(params, numel) if getattr(p, "ds_persist", False)),
        partition_whole=sum(p.numel() for group in in_partition for p in group) if in_partition else None,
        muon=sum(n for p, n in zip(params, numel) if getattr(p, "use_muon", False) and p.requires_grad),
        muon_whole=sum(p.numel() for group in in_partition for p in group if getattr(p, "use_muon", False))
        if in_partition else None,
        muon_groups=_muon_groups(optimizer),
        trainable=sum(trainable) if frozen else None,
        largest_trainable_tensor=max(trainable, default=0) if frozen else None,
        largest_trainable_layer=max(own_trainable, default=0) if frozen else None,
        experts=sum(n for p, n in zip(params, numel) if _is_expert(p)), **pipe)



def _muon_groups(optimizer) -> tuple[tuple[int, ...], ...]:
    """ZeRO-3 Muon: its sub-groups' Muon matrices (elements), in the order it gathers them."""
    if not getattr(optimizer, "use_muon", False) or not hasattr(optimizer, "sub_groups_using_muon"):
        return ()
    return tuple(tuple(p.ds_numel for p in group)
                 for group, muon in zip(optimizer.fp16_groups, optimizer.sub_groups_using_muon) if muon)


def _is_expert(param) -> bool:
    """A DeepSpeed AutoEP expert tensor (this rank's experts; module_inject/auto_ep_layer.py marks them
    allreduce=False, reduced over the expert-data-parallel group)."""
    return getattr(param, "allreduce", True) is False or getattr(param, "ds_zero_placement_family", "") == \
        "autoep_expert"


def model_config(spec, engine) -> dict:
    """The model's HF config as a dict: the live module's (a PipelineModule keeps it as hf_config), else the
    recipe's model by name; {} when neither answers (the planner then predicts no activations)."""
    module = getattr(engine, "module", None)
    config = getattr(module, "config", None) or getattr(module, "hf_config", None)
    if config is not None:
        return config if isinstance(config, dict) else config.to_dict()
    from harness.model_shapes import load_model_config

    try:
        return load_model_config(spec.recipe["train"]["model"])
    except (OSError, ValueError, KeyError):
        return {}


def run_of(spec, engine) -> RunModel:
    """This launch as the planner's RunModel: the session's spec.run (a bench script's stand-in spec without one
    gets it built from its recipe, DeepSpeed dict and the live module's config)."""
    run = getattr(spec, "run", None)
    return run if run is not None else RunModel.from_resolved(spec.recipe, spec.ds_config, spec.world_size,
                                                              model_config(spec, engine))


def for_run(spec, engine) -> dict:
    """This rank's predicted bytes; {"error": ...} rather than a crash when the planner cannot answer."""
    try:
        pipe = getattr(spec, "pp", 1) > 1
        facts = live_facts(engine.module, None if pipe else engine.optimizer, engine if pipe else None)
        return evaluate(run_of(spec, engine), live=facts).rank
    except (ValueError, KeyError, TypeError, UsageError) as e:
        return {"error": f"planner could not predict this run: {e}"}


def step_time_for_run(spec, engine, device: str, device_name: str, device_mem_bytes: int) -> dict:
    """{"step_time_s", "breakdown", "profile", "profile_source", ...} on the profile of the machine the run is on
    (planner/hardware.for_machine), or {"note": why not predicted}."""
    from harness.planner import hardware, layouts

    try:
        profile, source = hardware.for_machine(str(device), device_name, device_mem_bytes)
        if profile is None:
            return {"note": source}
        launch = getattr(spec, "launch", None)
        local = launch.local_size if launch is not None else spec.world_size
        cluster = layouts.hardware(local, max(1, spec.world_size // local), device_mem_bytes, None, None)
        run = run_of(spec, engine)
        t = evaluate(run, cluster, profile).time
        c, b = candidate(run), run.batch
        return {"step_time_s": t["step_time_s"], "breakdown": t["breakdown"], "tokens_per_s": t["tokens_per_s"],
                "per_stage": t["per_stage"], "mfu": t["mfu"], "profile": profile["name"], "profile_source": source,
                "layout": {"zero": c.stage, "offload_optimizer": c.offload_optimizer, "offload_param": c.offload_param,
                           "tp": c.tp, "pp": c.pp, "dp": run.degrees.dp, "micro_batch": b.micro_batch,
                           "grad_accum": b.grad_accum}}
    except Exception as e:  # a run must never fail because its prediction cannot be made
        return {"note": f"step time not predicted: {type(e).__name__}: {e}"}
