"""A real DeepSpeed engine per ZeRO stage on every rank at once, for `harness calibrate`.

The time model's compute term comes from the math (node.py); what a DeepSpeed step adds around it does
not: the optimizer step (gradient clipping, the mixed-precision wrapper's fp32 copies, the fused Adam kernel
DeepSpeed picks on this accelerator) and ZeRO's hooks (per-parameter gradient copies into buckets, ZeRO-3's
per-module fetch and release). Each rank builds the model cut to `layers` blocks, wraps it with
deepspeed.initialize at ZeRO stage 0, 1, 2 and 3 in the training precision with the recipes' optimizer
(AdamW, clipping 1.0), and ZeRO-2 with the optimizer offloaded (DeepSpeedCPUAdam and its copies), and times
forward + backward and engine.step() over a few steps, all ranks together as in training (memory bandwidth is
shared). Stage 0's engine stays up, and each step of stages 1-3 follows one of its steps, so the difference
the hook overhead comes from is taken under the same load (hooks.py). Each step's slowest rank is
kept, with the medians and fastest steps over them. node.py turns them into
optimizer_params_per_s and zero_overhead_s_per_tensor, taking out the collectives the time model prices
separately.
"""

from __future__ import annotations

import gc
import statistics
import time

STAGES = ("0", "1", "2", "3", "2-offload")  # ZeRO stage; "2-offload": ZeRO-2 with DeepSpeedCPUAdam on the host
HOOKED = ("1", "2", "3")  # the stages whose hook overhead is estimated: their steps alternate with stage 0's


def cut_config(cfg: dict, layers: int) -> dict:
    """The model config cut to `layers` blocks (what calibrate times: embedding, blocks, head, loss)."""
    return dict(cfg, **{"n_layer" if cfg.get("model_type") == "gpt2" else "num_hidden_layers": layers})


def cut_model(cfg: dict, layers: int):
    import transformers

    fields = {k: v for k, v in cut_config(cfg, layers).items() if k != "model_type"}
    return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(cfg["model_type"], **fields))


def ds_config(case: str, precision: str, micro_batch: int, world: int, hidden: int) -> dict:
    from harness.config.defaults import ALLGATHER_BUCKET_ELEMS, recipe_default
    from harness.planner.memory import harness_buckets

    b = harness_buckets(hidden)
    stage = int(case.split("-")[0])
    zero = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True,
            "reduce_bucket_size": b.reduce_bucket_elems, "allgather_bucket_size": ALLGATHER_BUCKET_ELEMS}
    if case.endswith("offload"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size=b.prefetch_bucket_elems,
                    stage3_param_persistence_threshold=b.param_persistence_threshold)
    return {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
            "train_batch_size": micro_batch * world, "gradient_clipping": recipe_default("gradient_clipping"),
            "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW",
                          "params": {"lr": 1e-4, "weight_decay": recipe_default("optimizer.weight_decay")}},
            "bf16": {"enabled": precision == "bf16"}, "fp16": {"enabled": precision == "fp16"},
            "zero_optimization": zero, "wall_clock_breakdown": False}


def measure(*, cfg: dict, seq_len: int, micro_batch: int, precision: str, layers: int = 2, steps: int = 8,
            pairs: int = 5) -> dict:
    """{"layers", "params", "stages": {stage: {"fwd_bwd_s", "step_s", ...}}}: medians of each step's slowest
    rank, and each step's times; stages 1-3 time `pairs` steps, each right after a stage-0 step."""
    import deepspeed
    import torch
    from deepspeed import comm as dist

    world = dist.get_world_size()
    hidden = cfg.get("hidden_size") or cfg.get("n_embd")
    out: dict = {"layers": layers, "stages": {}}
    base = None  # stage 0's engine, kept to interleave its steps with each hooked stage's (hooks.py)
    for stage in STAGES:
        torch.manual_seed(0)
        model = cut_model(cfg, layers)
        out["params"] = sum(p.numel() for p in model.parameters())
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=ds_config(stage, precision, micro_batch, world, hidden))
        ids = torch.randint(0, model.config.vocab_size, (micro_batch, seq_len), device=engine.device)
        paired = stage in HOOKED and base is not None
        out["stages"][stage] = _stage_times(engine, base if paired else None, ids, pairs if paired else steps)
        if stage == "0":
            base = engine
            continue
        engine.destroy()
        del engine, model
        gc.collect()
    if base is not None:
        base.destroy()
    return out


def _timed(engine, ids) -> tuple[float, float]:
    """Seconds of one forward + backward and of one engine.step(), the ranks starting together."""
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    dist.barrier()
    start = time.perf_counter()
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    accel.synchronize()
    middle = time.perf_counter()
    engine.step()
    accel.synchronize()
    return middle - start, time.perf_counter() - middle


def _stage_times(engine, base, ids, n: int) -> dict:
    """One stage's entry of measure: n timed steps after a warm-up, each right after a step of `base` (stage 0's
    engine) when given; each step's slowest rank, their medians and fastest."""
    import torch
    from deepspeed import comm as dist

    fwd_bwd, step, base_fwd_bwd = [], [], []
    for i in range(n + 1):
        if base is not None:  # stage 0 right before, under the same load
            b = _timed(base, ids)[0]
        f, s = _timed(engine, ids)
        if i:  # the first step warms up (ZeRO-3 traces the module order)
            fwd_bwd.append(f)
            step.append(s)
            if base is not None:
                base_fwd_bwd.append(b)
    # each step's slowest rank (the ranks start each step together)
    times = torch.tensor(fwd_bwd + step + base_fwd_bwd, dtype=torch.float64, device=engine.device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    fwd_bwd, step, base_fwd_bwd = (times[:n].tolist(), times[n:2 * n].tolist(), times[2 * n:].tolist())
    # medians, as training's step times are compared by their median; the fastest step beside them
    return {"fwd_bwd_s": statistics.median(fwd_bwd), "step_s": statistics.median(step),
            "fwd_bwd_min_s": min(fwd_bwd), "step_min_s": min(step), "fwd_bwd_samples_s": fwd_bwd,
            **({"base_fwd_bwd_samples_s": base_fwd_bwd} if base is not None else {})}
