"""An RL run's start (train.objective grpo), called by harness/train/job.py: the prompt set (or the replay file's
prompts), the reference when beta > 0 (train/reference*.py's engine and adapter modes), and the step object."""

from __future__ import annotations

from harness.config.rl_rules import reference_mode
from harness.errors import UsageError
from harness.log import say


def load_prompts(spec, dist, tokenizer):
    """Data(train=Prompts, eval=no prompts): RL evaluates nothing between steps (its metrics are the rollouts')."""
    from harness.rl import replay
    from harness.rl.prompts import Prompts, load
    from harness.train.trainer import Data

    rl, train = spec.recipe["rl"], spec.recipe["train"]
    if rl["replay"]:  # the file's own prompts: the run reads no dataset
        steps = replay.read(rl["replay"], (tokenizer.eos_token_id,))
        replay.check(steps, rl["replay"], total_steps=train["steps"], num_iterations=rl["num_iterations"],
                     completions=spec.run.batch.global_batch, num_generations=rl["num_generations"])
        # one prompt per group (replay.check: a group's lines share it), repeated prompts kept: the batch plan
        # needs a step's worth of rows even when every group asks the same (a multi-turn task's prompt often does)
        g = rl["num_generations"]
        prompts = Prompts([list(r["prompt_ids"]) for records in steps.values() for r in records[::g]],
                          tokenizer.pad_token_id or 0)
        seen = {tuple(p) for p in prompts.token_ids}
        note = f"replay {rl['replay']}: {sum(map(len, steps.values()))} completions of {len(seen)} prompts"
    else:
        from pathlib import Path

        from harness.rl.tools import load_toolbox

        prompts = load(train, rl, tokenizer, toolbox=load_toolbox(rl, Path.cwd()))
        note = (f"{train['dataset']}: {prompts.shape[0]} prompts of at most {prompts.shape[1]} tokens"
                + (f", {prompts.dropped} over rl.max_prompt_length {rl['max_prompt_length']} dropped"
                   if prompts.dropped else "") + f"; columns for the rewards: {', '.join(prompts.columns) or 'none'}")
        per_step = spec.run.batch.global_batch // rl["num_generations"]
        if prompts.shape[0] < per_step:
            raise UsageError(f"train.dataset {train['dataset']!r}: {prompts.shape[0]} prompts, fewer than one step's "
                             f"{per_step} (global batch {spec.run.batch.global_batch} completions / num_generations "
                             f"{rl['num_generations']})\n    fix: more prompts, a smaller batch or more generations")
    if dist.is_main:
        say("data", note)
    return Data(train=prompts, eval=Prompts([], prompts.pad_id))


def reference(spec, dist):
    """train/reference.Reference in engine or adapter mode; None when beta is 0 (no KL term: TRL loads none)."""
    from harness.train.reference import Reference

    mode = reference_mode(spec.recipe)
    if mode is None:
        if dist.is_main:
            say("rl", "reference: none (rl.beta 0: no KL term, no reference model loaded)")
        return None
    if mode == "adapter":
        if dist.is_main:
            say("rl", "reference: adapter (the policy's base with the LoRA adapters off): no second copy, one more "
                      "forward per generation")
        return Reference(mode)
    from harness.train.reference_engine import build_engine, reference_name

    engine, info = build_engine(spec)
    if dist.is_main:
        sharded = "ZeRO-3 sharded" if spec.zero_stage == 3 else "a whole copy"
        say("rl", f"reference: engine of {reference_name(spec)} ({info.num_params / 1e6:.2f}M params, {sharded}), "
                  "one more forward per generation")
    return Reference(mode, engine=engine)


def steps(spec, dist, data, run_dir, engine, tokenizer, step0: int, client: dict):
    """data with its RL step (harness/train/grpo.py) set up and started."""
    import dataclasses

    from harness.train.grpo import GrpoSteps

    rl_steps = GrpoSteps(spec, dist, data, run_dir, tokenizer=tokenizer, reference=reference(spec, dist))
    rl_steps.start(engine, step0, client)
    return dataclasses.replace(data, steps=rl_steps)
