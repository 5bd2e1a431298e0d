"""`--recipe auto`: ask the planner which recipe fits the hardware this launch found.

Hardware is read before any process group exists: ranks per node from the launch (harness.dist.Launch),
accelerator memory from the accelerator (on CPU: RAM shared by the local ranks), CPU RAM from psutil,
NVMe space from zero.nvme_path when one is set.
"""

from __future__ import annotations

import os
import shutil

from harness.dist import Launch
from harness.errors import UsageError
from harness.model_shapes import load_model_config
from harness.config.objectives import objective_of
from harness.config.recipes import complete


def detect_hardware(launch: Launch, nvme_path: str | None) -> dict:
    import psutil
    from deepspeed.accelerator import get_accelerator

    local, world_size = launch.local_size, launch.world_size
    accel = get_accelerator()
    cpu_mem = psutil.virtual_memory().total
    if accel.device_name() == "cpu":
        gpu_mem = cpu_mem // max(local, 1)  # ranks on one host share its RAM
    else:
        gpu_mem = accel.total_memory(launch.local_rank)
    nvme = shutil.disk_usage(nvme_path).free if nvme_path and os.path.isdir(nvme_path) else None
    name = "cpu"
    if accel.device_name() != "cpu":
        import torch

        name = torch.cuda.get_device_name(launch.local_rank)
    return {"gpus_per_node": local, "nodes": max(1, world_size // max(local, 1)), "gpu_mem_bytes": gpu_mem,
            "cpu_mem_bytes": cpu_mem, "nvme_bytes": nvme, "device": accel.device_name(), "device_name": name}


def choose(overrides: list[str], launch: Launch) -> tuple[str, list[str], str]:
    """(recipe name, planner overrides, one-line reason). User overrides are applied after these."""
    from harness.planner import hardware

    settings = complete({"description": "auto"}, "--recipe auto", overrides)
    train = settings["train"]
    hw = detect_hardware(launch, settings["zero"]["nvme_path"])
    profile, source = hardware.for_machine(hw["device"], hw["device_name"], hw["gpu_mem_bytes"])
    result = plan_for(settings, hw, profile)
    best, rollout_line = result.recommended, ""
    if best is not None and objective_of(settings).planner == "rollouts":  # the generation must fit beside training
        best, rollout_line = rl_layout(settings, hw, profile, result)
    if best is None:
        raise UsageError(f"--recipe auto: no strategy fits {train['model']} on {hw['nodes']} x {hw['gpus_per_node']} "
                         f"{hw['device']} ranks: " + "; ".join(result.missing))
    planned = [f"{k}={_literal(v)}" for k, v in best["overrides"].items()] + best.get("rl_overrides", [])
    reason = (f"planner chose {best['recipe']} for {train['model']} on {hw['nodes']} x {hw['gpus_per_node']} "
              f"{hw['device']} ranks ({hw['gpu_mem_bytes'] / 1e9:.1f} GB each): ")
    if "time" not in best:  # no hardware profile: memory alone decides
        reason += f"first fit in the decision order ({source})"
    else:
        cmp = result.comparison or {}
        reason += (f"{best['label']}, predicted {best['time']['step_time_s']:.3g} s/step on {source}"
                   + (f", {cmp['speedup']:.2f}x the first fit in the decision order ({cmp['first_fit']})"
                      if cmp and not cmp.get("kept_first_fit")
                      else ", the first fit in the decision order (fastest within 5 %)"))
    if train["datasets"]:  # a mixture: its sources' epochs from their stores (harness/data/mixture.py)
        from harness.data.mixture import plan_lines

        micro = best["overrides"].get("batch.micro_batch_per_gpu", settings["batch"]["micro_batch_per_gpu"])
        rows = (micro if isinstance(micro, int) else 1) * hw["gpus_per_node"] * hw["nodes"]
        from harness.model.hf import load_tokenizer

        reason += "\n" + "\n".join(plan_lines(train, rows, train["steps"], load_tokenizer(train["model"]))[0])
    return best["recipe"], planned, reason + rollout_line


def rl_layout(settings: dict, hw: dict, profile: dict, result) -> tuple[dict | None, str]:
    """The first fitting layout that also holds the generation (planner/rl.py fit_rollouts), with rl.gather_mb set
    when its ZeRO-3 gather must go by layer groups; (None, "") when none does (result.missing says why)."""
    from harness.config.defaults import PARAM_PERSISTENCE_THRESHOLD, PRECISION_BYTES
    from harness.planner import rl
    from harness.planner.inputs import RESERVE_FRACTION
    from harness.planner.params import count_params, model_shape

    cfg, batch, rl_keys = load_model_config(settings["train"]["model"]), settings["batch"], settings["rl"]
    per_rank = (batch["micro_batch_per_gpu"] if isinstance(batch["micro_batch_per_gpu"], int) else 1) * \
        (batch["grad_accum_steps"] if isinstance(batch["grad_accum_steps"], int) else 1)
    work = rl.RolloutWork(sequences=per_rank, prompt_len=rl_keys["max_prompt_length"],
                          completion_len=rl_keys["max_completion_length"], generator=rl_keys["generator"],
                          sync_bucket_mb=rl_keys["sync_bucket_mb"])
    ordered = [result.recommended] + [c for c in result.candidates if c is not result.recommended]
    layout, plan = rl.fit_rollouts(ordered, count_params(cfg), model_shape(cfg), work, lp=PRECISION_BYTES[
        settings["precision"]], gpu_mem_bytes=hw["gpu_mem_bytes"], threshold=PARAM_PERSISTENCE_THRESHOLD,
        reserve=RESERVE_FRACTION, profile=profile, async_on_gpu=rl_keys["async"] and rl.async_device(
            rl_keys["async_generator_device"], hw["device"]) == "cuda")
    if layout is None:
        result.missing.append("no layout leaves room for the generation (KV cache and one gathered layer group; "
                              "under rl.async on the GPU, the generator's weights copy and KV cache) beside "
                              "training: fewer completions per rank, a shorter rl.max_completion_length, or "
                              "rl.async_generator_device=cpu")
        return None, ""
    gather = plan["gather"]
    layout = dict(layout)
    layout["rl_overrides"] = [] if gather["whole"] or rl_keys["gather_mb"] != "auto" else \
        [f"rl.gather_mb={(gather['peak_bytes'] - gather['persistent_bytes']) / rl.MIB:.3f}"]
    return layout, (f"; rollouts: {plan['recommend']} (KV cache {plan['kv_cache_bytes'] / rl.MIB:.1f} MiB, "
                    f"{plan['gather_reason']})")


def plan_for(settings: dict, hw: dict, profile: dict):
    """The planner's answer for a completed recipe on the hardware found (detect_hardware's dict): its model,
    seq_len (a sequence one rank cannot hold gets the long-context rung: sp, tiling, activation offload),
    micro-batch, precision, checkpointing, attention and objective (a preference run's pairs and reference; an RL
    run's completions of rl.max_prompt_length + rl.max_completion_length tokens and its reference when beta > 0;
    a distillation run's teacher in the mode the run resolves)."""
    from harness.planner import plan
    from harness.planner.inputs import Cluster, Workload

    from harness.config.preference_rules import is_preference, objective, packing, reference_mode
    from harness.config.run_model import OptimizerDtypes, completions, optimizer_states
    from harness.planner.rank import completions_goal

    train, micro, opt = settings["train"], settings["batch"]["micro_batch_per_gpu"], settings["optimizer"]
    # a preference run: two sequences per pair, its reference's bytes, and no tp / pp / sp (planner/reference.py)
    goal = {"objective": objective(settings), "reference_mode": reference_mode(settings)} \
        if is_preference(settings) else {}
    seq_len, done = train["seq_len"], completions(settings)
    if done is not None:  # grpo: completions of the rl block's lengths, its reference; gkd, distill: the teacher
        seq_len, goal = completions_goal(done, train["model"], load_model_config(train["model"]), seq_len)
    cluster = Cluster(hw["gpus_per_node"], hw["gpu_mem_bytes"], hw["nodes"], hw["cpu_mem_bytes"], hw["nvme_bytes"])
    work = Workload(seq_len, micro if isinstance(micro, int) else 1, settings["precision"],
                    settings["activation_checkpointing"],
                    attention=planner_attention(train.get("attention"), hw["device"]),
                    activation_offload=hw["device"] != "cpu",  # DeepSpeed's offload does nothing on CPU: refused there
                    packing=packing(settings),
                    optimizer_states=optimizer_states({"optimizer": {"type": settings["optimizer"]["type"]}}),
                    optimizer_dtypes=OptimizerDtypes.named(opt["type"], opt["master_dtype"], opt["state_dtype"]), **goal)
    return plan(load_model_config(train["model"]), cluster, work, model_name=train["model"], hardware_profile=profile)


def planner_attention(value: str | None, device: str) -> str:
    """train.attention as the planner's kernel: flash-attention and flex build no mask; auto is flash-attention on a
    GPU with flash-attn installed, else sdpa (under SP the harness's document_sdpa: planner/activations.py)."""
    import importlib.util

    text = str(value or "auto").lower()
    for kind in ("flash", "flex", "eager"):
        if kind in text:
            return kind
    if text == "auto" and device != "cpu" and importlib.util.find_spec("flash_attn") is not None:
        return "flash"
    return "sdpa"


def _literal(value) -> str:
    import json

    return value if isinstance(value, str) and value != "auto" else json.dumps(value)
