"""Rules for online RL (train.objective grpo, the rl block): the reference a run gets, and what is refused before
launch with the reason, among them what TRL 1.16 only warns about or gets wrong silently (cispo under the default
epsilon_high, a generation batch that num_generations does not divide, a group of one). Pure: the recipe and the
DeepSpeed dict only; the replay file and the prompt set are read in harness/train/checks.py.
"""

from __future__ import annotations

from harness.config.adapter_rules import lora_on
from harness.config.objectives import family
from harness.config.layout_refusals import refused_layouts
from harness.config.resolve import BATCH_KEYS, Context, degrees, is_count, sequence_parallel
from harness.errors import Problem


def is_rl(recipe: dict) -> bool:
    return family(recipe) == "rl"


def epsilon_high(rl: dict) -> float:
    """TRL: epsilon_high defaults to epsilon."""
    return rl["epsilon"] if rl.get("epsilon_high") is None else rl["epsilon_high"]


def reference_mode(recipe: dict) -> str | None:
    """engine or adapter; None when the run has no reference (not grpo, or beta 0: TRL loads none). auto: the
    adapters off under LoRA when no other reference is named (no second copy), else a frozen engine."""
    if not is_rl(recipe) or recipe["rl"]["beta"] == 0:
        return None
    rl = recipe["rl"]
    if rl["reference_mode"] != "auto":
        return rl["reference_mode"]
    return "adapter" if lora_on(recipe) and rl["reference"] is None else "engine"


def global_completions(ds: dict, ctx: Context) -> int | None:
    """Completions per optimizer step (train_batch_size), when the dict or the world says it."""
    tbs, micro, gas = (ds.get(k) for k in BATCH_KEYS)
    if is_count(tbs):
        return int(tbs)
    if ctx.world_size is not None and is_count(micro) and is_count(gas):
        pp, tp = degrees(ds, ctx.recipe)
        return int(micro * gas * max(ctx.world_size // (pp * tp * sequence_parallel(ds)), 1))
    return None


def check_rl(ds: dict, ctx: Context) -> list[Problem]:
    recipe = ctx.recipe
    if not is_rl(recipe):
        return []
    rl, out = recipe.get("rl", {}), []
    g = rl.get("num_generations", 8)
    if g < 2:
        out.append(Problem("rl.num_generations", f"num_generations {g}: a group of one has no spread, every "
                           "advantage is 0 and nothing is learned (TRL refuses it too late, at the first step)",
                           "set rl.num_generations >= 2"))
    if (total := global_completions(ds, ctx)) is not None and g >= 2 and total % g:
        out.append(Problem("rl.num_generations", f"the global batch counts completions: train_batch_size {total} "
                           f"is not a multiple of num_generations {g} ({total} / {g} = {total / g:.2f} prompts per "
                           "step)", f"make batch.micro_batch_per_gpu x grad_accum_steps x data-parallel ranks a "
                           f"multiple of {g}, or pick num_generations dividing {total}"))
    if rl.get("loss_type") == "cispo" and epsilon_high(rl) < 1:
        source = " from epsilon: epsilon_high is null" if rl.get("epsilon_high") is None else ""
        out.append(Problem("rl.epsilon_high", f"loss_type cispo caps the importance weight itself at epsilon_high "
                           f"({epsilon_high(rl)}{source}): "
                           "every weight would be at most that, scaling every update down (TRL does this silently)",
                           "set rl.epsilon_high >= 1 (MiniMax-M1 uses 5.0)"))
    if not rl.get("rewards") and not rl.get("replay") and not rl.get("environment_factory") and \
            recipe.get("train", {}).get("dataset") != "builtin":
        out.append(Problem("rl.rewards", "no reward: rl.rewards is empty and the prompts are not the built-in toy task "
                           "(whose reward is the default)", "add entries, e.g. rl.rewards=[\"my_rewards.py:accuracy\"] "
                           "(TRL's reward signature), or set rl.replay to a rollouts file"))
    return (out + _reference_problems(recipe, rl) + _async_problems(rl) + _server_problems(rl)
            + _layout_problems(ds, recipe))


def _server_problems(rl: dict) -> list[Problem]:
    """rl.vllm_mode server outside what it serves: rl.async with rl.generator=vllm."""
    if rl.get("vllm_mode", "colocate") != "server":
        return []
    if rl.get("generator", "hf") != "vllm":
        return [Problem("rl.vllm_mode", f"vllm_mode server with generator {rl.get('generator', 'hf')}: the mode "
                        "says where vLLM runs, and this run does not generate with vLLM", "set rl.generator=vllm "
                        "(with rl.async=true), or drop rl.vllm_mode")]
    if not rl.get("async"):
        return [Problem("rl.vllm_mode", "vllm_mode server without rl.async: the synchronous vLLM path is colocated "
                        "(a vLLM on every rank); the server is asked by rl.async's schedule only",
                        "set rl.async=true (rl.max_staleness 0 is the synchronous schedule), or "
                        "rl.vllm_mode=colocate")]
    return []


def _async_problems(rl: dict) -> list[Problem]:
    """rl.async with what it does not combine with (harness/rl/async_rollouts.py)."""
    if not rl.get("async"):
        return []
    out, off = [], "or set rl.async=false"
    if rl.get("replay"):
        out.append(Problem("rl.async", f"rl.async with rl.replay {rl['replay']!r}: a replay trains on recorded "
                           "rollouts and generates nothing, so there is nothing to overlap",
                           f"drop rl.replay (its lines train as they are without async), {off}"))
    if rl.get("num_iterations", 1) > 1:
        out.append(Problem("rl.num_iterations", f"rl.async with num_iterations {rl['num_iterations']}: the "
                           "asynchronous generator feeds one optimizer step per generation (TRL's AsyncGRPO has no "
                           "num_iterations either)", f"set rl.num_iterations=1, {off}"))
    if rl.get("tools") or rl.get("environment_factory"):
        out.append(Problem("rl.async", "rl.async with tools or an environment_factory: multi-turn rollouts run "
                           "their tools and turns on the trainer ranks (lockstep under ZeRO-3); the generator "
                           "processes sample single-turn rollouts only", f"drop rl.tools / rl.environment_factory, "
                           f"{off}"))
    if rl.get("generator", "hf") == "vllm" and rl.get("vllm_mode", "colocate") != "server":
        out.append(Problem("rl.vllm_mode", "rl.async with generator vllm and vllm_mode colocate: the asynchronous "
                           "generator is either HF generate in processes of its own (rl.generator=hf) or a vLLM "
                           "server on GPUs of its own; a vLLM colocated on the trainer's GPU would stop training "
                           "while it samples", f"set rl.vllm_mode=server (and start trl vllm-serve: docs/rl.md), or "
                           f"rl.generator=hf, {off}"))
    return out


def _reference_problems(recipe: dict, rl: dict) -> list[Problem]:
    mode, ref, out = rl.get("reference_mode", "auto"), rl.get("reference"), []
    if mode == "precomputed":
        out.append(Problem("rl.reference_mode", "reference_mode precomputed with objective grpo: the completions "
                           "are generated during training, so there is nothing to score before it",
                           "use reference_mode engine (a frozen copy) or adapter (under LoRA), or auto"))
    elif mode == "adapter" and not lora_on(recipe):
        out.append(Problem("rl.reference_mode", "reference_mode adapter without LoRA: the reference is the base with "
                           "the adapters switched off, and there are none", "set adapter.type=lora, or use engine"))
    elif mode == "adapter" and ref is not None:
        out.append(Problem("rl.reference", f"reference_mode adapter with a reference model ({ref}): the adapter "
                           "mode's reference is the policy's own base", "drop rl.reference, or use engine"))
    if rl.get("beta", 0) == 0 and (ref is not None or mode not in ("auto", "precomputed")):
        out.append(Problem("rl.beta", f"beta 0 with a reference ({ref or mode}): no reference is loaded when beta "
                           "is 0 (no KL term)", "set rl.beta > 0 (TRL's papers use 0.04), or drop the reference",
                           severity="warning"))
    return out


def _layout_problems(ds: dict, recipe: dict) -> list[Problem]:
    """Layouts whose step does not run a completion through one forward of the whole model."""
    why = {"parallel.pipeline": "generation runs the whole model per token; a pipeline holds one stage",
           "parallel.tensor": "the tensor-parallel head's logits are split by vocabulary; the per-token log-probs "
                              "and the sampling need the whole vocabulary",
           "parallel.sequence": "each rank holds a slice of every sequence; generation extends whole sequences "
                                "token by token"}
    return refused_layouts(ds, recipe, "grpo", why, tiled="the RL loss needs each completion token's log-prob",
                           loss_name="the RL loss")
