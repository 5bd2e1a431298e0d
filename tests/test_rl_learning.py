"""Online RL learns and resumes (issue 38), in ONE 2-rank launch (tests/drivers/jobs.py):
- the built-in toy task (harness/rl/toy.py, reply in vowels) on the built-in tiny Llama: the mean reward rises from
  the untrained ~0.23 on ZeRO-2, ZeRO-3 and LoRA, generating with rl.generator hf in the loop (TRL's GRPOTrainer on
  the same task and hyperparameters: bench/rl.py, docs/rl.md);
- a run stopped mid-generation (num_iterations 2, saved at step 3) and resumed equals the uninterrupted run: the
  losses and rollouts.jsonl, byte for byte;
- rl.replay of the uninterrupted run's rollouts.jsonl reproduces its losses bit for bit.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from helpers.launch import launch_jobs, records

LEARN_STEPS = 15
BASE = {"train.model": "tiny-llama", "train.objective": "grpo", "precision": "fp32", "batch.micro_batch_per_gpu": 8,
        "batch.grad_accum_steps": 1, "batch.train_batch_size": '"auto"', "optimizer.type": "adamw",
        "optimizer.lr": 3e-2, "optimizer.weight_decay": 0, "scheduler.type": "none", "gradient_clipping": 1.0,
        "rl.num_generations": 4, "rl.max_completion_length": 8, "train.log_every": 1, "train.save_every": 0}


def argv(out: Path, recipe: str, **sets) -> list[str]:
    args = ["--recipe", recipe, "--output-dir", str(out), "--profile-steps", ""]
    for key, value in {**BASE, **sets}.items():
        args += ["--set", f"{key}={value}"]
    return args


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    import time

    root = tmp_path_factory.mktemp("rl_learning")
    short = {"train.steps": 4, "rl.num_iterations": 2, "rl.temperature": 0.9}
    cases = [argv(root / "zero2", "zero2", **{"train.steps": LEARN_STEPS}),
             argv(root / "zero3", "zero3", **{"train.steps": LEARN_STEPS}),
             argv(root / "lora", "zero2", **{"train.steps": LEARN_STEPS, "adapter.type": "lora", "adapter.r": 16,
                                             "adapter.alpha": 32, "adapter.dropout": 0, "optimizer.lr": 5e-2}),
             argv(root / "whole", "zero2", **short),
             argv(root / "stopped", "zero2", **{**short, "train.steps": 3}),
             argv(root / "stopped", "zero2", **short) + ["--resume", str(root / "stopped" / "checkpoints" /
                                                                          "global_step3")],
             argv(root / "replayed", "zero2", **short, **{"rl.replay": root / "whole" / "rollouts.jsonl"})]
    start = time.perf_counter()
    proc = launch_jobs(cases, root, ranks=2, timeout_s=900)
    return root, proc, time.perf_counter() - start


@pytest.mark.multirank
@pytest.mark.parametrize("layout", ["zero2", "zero3", "lora"])
def test_the_mean_reward_rises_on_the_toy_task(launched, layout):
    root, _, seconds = launched
    rewards = [r["reward"] for r in records(root / layout, "train")]
    first, last = statistics.mean(rewards[:3]), statistics.mean(rewards[-3:])
    print(f"{layout}: reward {first:.3f} -> {last:.3f} over {len(rewards)} steps (launch {seconds:.1f}s)")
    assert len(rewards) == LEARN_STEPS and first < 0.4 and last > first + 0.25, rewards


@pytest.mark.multirank
def test_a_resumed_run_equals_the_uninterrupted_one_rollouts_included(launched):
    root, _, _ = launched
    whole, stopped = records(root / "whole", "train"), records(root / "stopped", "train")
    assert [r["loss"] for r in stopped] == [r["loss"] for r in whole]
    assert (root / "stopped" / "rollouts.jsonl").read_text() == (root / "whole" / "rollouts.jsonl").read_text()
    lines = [json.loads(line) for line in (root / "whole" / "rollouts.jsonl").read_text().splitlines()]
    assert {r["step"] for r in lines} == {1, 3} and all(len(r["old_logps"]) > 0 for r in lines)


@pytest.mark.multirank
def test_replaying_the_rollouts_reproduces_the_losses_bit_for_bit(launched):
    root, _, _ = launched
    assert [r["loss"] for r in records(root / "replayed", "train")] == \
        [r["loss"] for r in records(root / "whole", "train")]
