"""`harness plan --objective ...`: the objective's flags as the planner's Workload fields, refused as a run would
refuse them, and the generation section of an objective whose completions are generated in the loop. What is
priced follows the registry's planner field (harness/config/objectives.py): pairs (a preference pair and its
reference), rollouts (grpo: completions, their generation and a reference when beta > 0), distill (gkd, distill: the
teacher per mode, the generation when on-policy)."""

from __future__ import annotations

import argparse

from harness.config.defaults import PRECISION_BYTES, REFERENCE_FREE, recipe_default
from harness.config.objectives import OBJECTIVES
from harness.errors import UsageError

GENERATED = ("rollouts", "distill")  # planner fields whose rows are completions of prompt + completion tokens


def terms(args: argparse.Namespace) -> str:
    return OBJECTIVES[args.objective].planner


def seq_len(args: argparse.Namespace, default: int) -> int:
    """A completion's row (prompt + completion tokens) for grpo, gkd, distill; else --seq-len or the default."""
    if terms(args) not in GENERATED:
        return args.seq_len or default
    if args.seq_len is not None:
        raise UsageError(f"--seq-len {args.seq_len} with --objective {args.objective}: its rows are a prompt and a "
                         "completion; give --max-prompt-length and --max-completion-length instead")
    prompt, completion = lengths(args)
    for flag, value in (("--max-prompt-length", prompt), ("--max-completion-length", completion)):
        if value < 1:
            raise UsageError(f"{flag} {value}: must be at least 1")
    return prompt + completion


def lengths(args: argparse.Namespace) -> tuple[int, int]:
    """(prompt, completion) tokens of a row: the flags, else the objective's defaults (the rl block's for grpo; for
    gkd and distill the resolved distill block's generation length: TRL's max_new_tokens, max_completion_length)."""
    prompt = recipe_default("rl.max_prompt_length") if args.max_prompt_length is None else args.max_prompt_length
    if args.max_completion_length is not None:
        return prompt, args.max_completion_length
    if terms(args) == "rollouts":
        return prompt, recipe_default("rl.max_completion_length")
    trl = settings(args)
    return prompt, trl["max_new_tokens"] or trl["max_completion_length"]


def objective_work(args: argparse.Namespace, cfg: dict, resolve) -> dict:
    """The Workload fields of --objective and its flags (none for lm); resolve: a model spec -> its config dict
    (commands/plan.resolve_model), for --teacher."""
    goal, mode, kind = args.objective, args.reference_mode, terms(args)
    given = [f for f, v in (("--teacher", args.teacher), ("--records", args.records), ("--lmbda", args.lmbda))
             if v is not None] + (["--teacher-mode"] if args.teacher_mode != "auto" else [])
    if given and kind != "distill":
        raise UsageError(f"{', '.join(given)} plan a distillation run: add --objective gkd (or distill)")
    _generator_flags(args, kind)
    if goal == "lm":
        if mode != "auto" or args.pairs is not None or (args.steps is not None and not args.datasets):
            raise UsageError("--reference-mode, --pairs and --steps plan a preference run: add --objective dpo "
                             "(or ipo, simpo, orpo); --steps also goes with --datasets (a mixture's epochs)")
        return {}
    if kind != "pairs" and args.pairs is not None:
        raise UsageError(f"--pairs with --objective {goal}: its batch items are completions, not pairs")
    if goal in REFERENCE_FREE and mode != "auto":
        raise UsageError(f"--reference-mode {mode} with --objective {goal}: {goal} has no reference model")
    if mode == "adapter" and not args.lora_r:
        raise UsageError("--reference-mode adapter needs LoRA (--lora-r R): the reference is the base with the "
                         "adapters switched off")
    out = {"objective": goal, "reference_mode": None if mode == "auto" else mode, "pairs": args.pairs,
           "steps": args.steps}
    if kind in GENERATED:
        out.update(zip(("prompt_len", "completion_len"), lengths(args)))
    if kind == "rollouts":
        beta = recipe_default("rl.beta") if args.beta is None else args.beta
        if mode == "precomputed":
            raise UsageError(f"--reference-mode precomputed with --objective {goal}: the completions are generated "
                             "during training, so there is nothing to score before it; use engine or adapter")
        if mode != "auto" and not beta:
            raise UsageError(f"--reference-mode {mode} with --objective {goal} and beta 0: no reference is loaded "
                             "when beta is 0 (no KL term); add --beta 0.04 (or drop --reference-mode)")
        out["beta"] = beta
    if kind == "distill":
        if mode != "auto":
            raise UsageError(f"--reference-mode with --objective {goal}: a distillation run has a teacher, not a "
                             "reference; use --teacher-mode")
        out["teacher"] = _teacher(args, cfg, resolve)
    return out


def _teacher(args: argparse.Namespace, cfg: dict, resolve):
    """planner/teacher.TeacherLoad of --teacher (default: the student's own model) and its flags, checked."""
    from harness.planner import teacher

    for flag, value in (("--loss-top-k", args.loss_top_k), ("--records", args.records)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} {value}: must be at least 1")
    for flag, value in (("--lmbda", args.lmbda), ("--beta", args.beta)):
        if value is not None and not 0 <= value <= 1:
            raise UsageError(f"{flag} {value}: must be in [0, 1] (TRL's meaning: a share, a mixture weight)")
    name = args.teacher or args.model
    teacher_cfg = cfg if args.teacher is None else resolve(args.teacher)
    if teacher_cfg.get("vocab_size") != cfg.get("vocab_size"):
        raise UsageError(f"--teacher {name}: its vocabulary ({teacher_cfg.get('vocab_size')}) is not the student's "
                         f"({cfg.get('vocab_size')}); cross-tokenizer distillation is not supported: choose a "
                         "teacher of the student's family and tokenizer")
    trl = settings(args)
    load = teacher.teacher_load(name, teacher_cfg, cfg, is_student=args.teacher in (None, args.model),
                                beta=trl["beta"], chunk_tokens=trl["loss_chunk_tokens"],
                                mode=None if args.teacher_mode == "auto" else args.teacher_mode,
                                top_k=args.loss_top_k, on_policy=trl["on_policy"], lmbda=trl["lmbda"],
                                records=args.records)
    why_not = teacher.refused(load, lora=bool(args.lora_r)).get(args.teacher_mode)
    if why_not:
        raise UsageError(f"--teacher-mode {args.teacher_mode} with --objective {args.objective}: {why_not}")
    return load


def block(args: argparse.Namespace) -> str:
    """The recipe block that holds the generator's keys: rl for grpo, distill for gkd and distill."""
    return "rl" if terms(args) == "rollouts" else "distill"


def vllm_share(args: argparse.Namespace) -> float:
    """vLLM's share of the GPU: --vllm-gpu-memory-utilization, else the block's default (TRL's 0.3)."""
    given = args.vllm_gpu_memory_utilization
    return recipe_default(f"{block(args)}.vllm_gpu_memory_utilization") if given is None else given


def _generator_flags(args: argparse.Namespace, kind: str) -> None:
    """--generator vllm and --vllm-gpu-memory-utilization go with a run that generates in the loop."""
    share = args.vllm_gpu_memory_utilization
    if share is not None and not 0 < share <= 1:
        raise UsageError(f"--vllm-gpu-memory-utilization {share}: a share of the GPU, in (0, 1] (TRL's default "
                         f"{recipe_default('rl.vllm_gpu_memory_utilization')})")
    if args.generator != "vllm" and share is None:
        return
    flag = "--generator vllm" if args.generator == "vllm" else "--vllm-gpu-memory-utilization"
    if kind not in GENERATED:
        raise UsageError(f"{flag} with --objective {args.objective}: nothing is generated in its loop; it prices "
                         "grpo's, gkd's and distill's generation")
    if kind == "distill" and not settings(args)["on_policy"]:
        raise UsageError(f"{flag} with --objective {args.objective} and lmbda 0: the student generates nothing "
                         "(distill.use_vllm serves only its on-policy completions); add --lmbda 0.5 (TRL's) or drop "
                         f"{flag}")


def settings(args: argparse.Namespace) -> dict:
    """The distill block a run with these flags resolves (harness/config/distill_rules.settings: a flag not given
    takes the objective's TRL default), with on_policy: whether the student generates some completions."""
    from harness.config.distill_rules import on_policy
    from harness.config.distill_rules import settings as resolved

    block = {key: recipe_default(f"distill.{key}") for key in ("beta", "lmbda", "seq_kd", "temperature",
                                                               "loss_temperature", "loss_chunk_tokens")}
    block.update({k: v for k, v in (("beta", args.beta), ("lmbda", args.lmbda)) if v is not None})
    recipe = {"train": {"objective": args.objective}, "distill": block}
    return {**resolved(recipe), "on_policy": on_policy(recipe)}


def generates(args: argparse.Namespace, work) -> bool:
    """Whether the run generates completions in the loop: grpo, distill, gkd with lmbda > 0."""
    return terms(args) == "rollouts" or (work.teacher is not None and work.teacher.on_policy)


def rollout_section(args, cfg: dict, result, gpu_mem: int, profile: dict) -> dict | None:
    """planner/rl.py's generation plan on the recommended (or evaluated) layout."""
    from harness.config.defaults import PARAM_PERSISTENCE_THRESHOLD
    from harness.planner import rl
    from harness.planner.inputs import RESERVE_FRACTION
    from harness.planner.params import count_params, model_shape

    layout = result.recommended or result.evaluated
    if not layout:
        return None
    lp = PRECISION_BYTES[args.precision]
    free = int(gpu_mem * (1 - RESERVE_FRACTION)) - int(layout["memory"]["gpu_bytes"])
    prompt, completion = lengths(args)
    work = rl.RolloutWork(sequences=args.micro_batch * args.grad_accum, prompt_len=prompt,
                          completion_len=completion, generator=args.generator,
                          vllm_memory_fraction=vllm_share(args), block=block(args),
                          gather_bound_bytes=None if args.gather_mb is None else int(args.gather_mb * rl.MIB),
                          sync_bucket_mb=args.sync_bucket_mb,
                          turns=max(getattr(args, "max_tool_calling_iterations", 0) or 0, 0) + 1,
                          tool_result_tokens=max(getattr(args, "tool_result_tokens", 0) or 0, 0))
    out = rl.rollout_plan(count_params(cfg), model_shape(cfg), work, stage=int(layout["zero_stage"]),
                          world=int(layout["dp"]), lp=lp, threshold=PARAM_PERSISTENCE_THRESHOLD,
                          free_bytes=free, gpu_mem_bytes=gpu_mem, profile=profile)
    share = {} if terms(args) == "rollouts" else {"lmbda": settings(args)["lmbda"]}
    if getattr(args, "rl_async", False) and terms(args) == "rollouts":
        hf, step = out["hf"], next((t["step_time_s"] for t in (layout.get("time"), (result.evaluated or {})
                                                                 .get("time")) if t), 0.0)
        out["async"] = rl.async_plan(model_bytes=lp * count_params(cfg).total, kv_bytes=out["kv_cache_bytes"],
                                     generate_s=hf["prefill_s"] + hf["decode_s"], train_s=step,
                                     sync_s=out["vllm"]["sync"]["seconds"], max_staleness=args.max_staleness,
                                     device=rl.async_device(args.async_generator_device, "cuda"), free_bytes=free)
    return {"layout": layout["label"], "free_bytes": free, "sequences_per_rank": work.sequences,
            "num_generations": args.num_generations, **share, **out}


def render_rollouts(r: dict) -> str:
    mib = 1 << 20
    g, hf, vllm = r["gather"], r["hf"], r["vllm"]
    how = "whole model once per call" if g["whole"] else \
        f"layer groups of {g['layers_per_group']} ({g['num_groups']} per token)"
    return "\n".join([
        "", f"Rollouts on {r['layout']} ({r['sequences_per_rank']} completions per rank per step, " + (
            f"{r['num_generations']} per prompt" if "lmbda" not in r else "the student's, every micro-batch"
            if r["lmbda"] >= 1 else f"the student's, on a share {r['lmbda']:g} of micro-batches")
            + f"; {r['free_bytes'] / mib:,.0f} MiB free beside training):",
        f"  KV cache         {r['kv_cache_bytes'] / mib:,.1f} MiB (2 x layers x kv_heads x head_dim x tokens x "
        "sequences x bytes)",
        f"  hf gather        {how}: peak {g['peak_bytes'] / mib:,.1f} MiB held, {g['per_token_gather_bytes'] / mib:,.1f}"
        f" MiB gathered per token ({r['gather_reason']})",
        f"  hf time          prefill {hf['prefill_s']:.3f} s ({r['prefill_tokens']:,} tokens per sequence over "
        f"{r['turns']} turn(s)), decode {hf['decode_s']:.3f} s ({r['sampled_tokens']:,} sampled tokens"
        + (f", {r['tool_tokens']:,} tool tokens prefilled" if r["tool_tokens"] else "") + ")",
        f"  vllm             {vllm['bytes'] / mib:,.1f} MiB needed of a {vllm['budget_bytes'] / mib:,.0f} MiB share; "
        f"decode {vllm['decode_s']:.3f} s; weight sync {vllm['sync']['bytes'] / mib:,.1f} MiB in "
        f"{vllm['sync']['buckets']} bucket(s), {vllm['sync']['seconds']:.3f} s per step",
        f"  recommend        {r['recommend']}", *render_async(r.get("async")), ""])


def render_async(a: dict | None) -> list[str]:
    if a is None:
        return []
    mib = 1 << 20
    where = "of host memory" if a["device"] == "cpu" else "on the trainer rank's GPU"
    fit = [] if a["device"] == "cpu" else [
        f"  async fit        {a['gpu_bytes_per_rank'] / mib:,.1f} MiB per GPU beside training, "
        f"{a['free_bytes'] / mib:,.1f} MiB free: " + ("fits" if a["fits"] else
                                                     "does not fit; set rl.async_generator_device=cpu, or fewer "
                                                     "completions per rank, a shorter max_completion_length")]
    return [f"  async            {a['generators_per_rank']} generator process per rank: {a['bytes_per_process'] / mib:,.1f}"
            f" MiB {where} each (a weights copy {a['weights_bytes'] / mib:,.1f} MiB + KV cache "
            f"{a['kv_cache_bytes'] / mib:,.1f} MiB)", *fit,
            f"  async step       {a['async_step_s']:.3f} s (max(generate, train) + sync) against {a['sync_step_s']:.3f} s "
            f"synchronous: x{a['gain']:.2f}, {a['bound']}-bound"]
