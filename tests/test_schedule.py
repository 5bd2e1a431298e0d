"""The learning-rate schedule's step convention and what a resume does to it (harness/train/schedule.py, issue 41).

Convention (docs/checkpoints.md, the schema's scheduler description): step k (1-based) trains at the scheduler's
iteration k, so linear warmup over W steps trains step k at lr x k / W; the decaying schedules end at
train.steps + 1. The math is checked in-process on DeepSpeed's own scheduler objects for every type the recipes
offer; one 2-rank launch checks the wiring: the lr each step logged (read from the optimizer's param group just
before the step) for a fresh run, a resume with a longer train.steps, and a resume onto a constant lr.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from deepspeed.runtime import lr_schedules

from harness.config import builder
from harness.config.recipes import complete
from harness.config.schema import RECIPE_SCHEMA, load_schema
from harness.train import schedule

LR, W, T, COS_MIN = 3e-3, 3, 6, 0.1


def expected(kind: str, k: int, lr: float = LR, warmup: int = W, total: int = T) -> float:
    """The documented lr of step k (1-based), written out independently of DeepSpeed's code."""
    if kind == "none":
        return lr
    if k < warmup or (k == warmup and kind != "WarmupCosineLR"):
        return lr * k / warmup
    if kind == "WarmupLR":
        return lr
    if kind == "WarmupDecayLR":
        return lr * (total + 1 - k) / (total + 1 - warmup)
    progress = min(1.0, (k - warmup + 1) / (total + 1 - warmup))  # DeepSpeed's cosine starts at step W
    return lr * (COS_MIN + (1 - COS_MIN) * (1 + math.cos(math.pi * progress)) / 2)


def recipe(kind: str, steps: int = T) -> dict:
    return complete({"description": "x", "optimizer": {"lr": LR}, "scheduler": {"type": kind, "warmup_steps": W}},
                    "x", [f"train.steps={steps}"])


def engine_like(kind: str, steps: int = T):
    """DeepSpeed's scheduler object for the harness-built block, on a real torch optimizer: what the engine holds
    as lr_scheduler and optimizer (the engine builds it the same way: getattr(lr_schedules, type)(opt, **params))."""
    block = builder.build(recipe(kind, steps)).get("scheduler")
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    scheduler = getattr(lr_schedules, block["type"])(optimizer, **block["params"]) if block else None
    return SimpleNamespace(lr_scheduler=scheduler, optimizer=optimizer)


def run(engine, first: int, last: int) -> dict[int, float]:
    """Steps first..last as the engine takes them: lr read before the step, the scheduler stepped after it."""
    out = {}
    for k in range(first, last + 1):
        out[k] = engine.optimizer.param_groups[0]["lr"]
        if engine.lr_scheduler is not None:
            engine.lr_scheduler.step()
    return out


SCHEDULERS = load_schema(RECIPE_SCHEMA)["properties"]["scheduler"]["properties"]["type"]["enum"]


@pytest.mark.parametrize("kind", SCHEDULERS)
def test_every_step_trains_at_the_documented_lr(kind):
    engine = engine_like(kind)
    schedule.align(engine, 0)
    got = run(engine, 1, T)
    want = {k: expected(kind, k) for k in got}
    assert got == pytest.approx(want, rel=1e-12), kind
    assert all(lr > 0 for lr in got.values()), f"{kind}: a step at lr 0: {got}"
    if kind != "none":
        assert got[1] == pytest.approx(LR / W)  # the first nonzero warmup value, not lr 0


def test_without_alignment_deepspeed_trains_two_steps_at_lr_0():
    """What the alignment fixes: DeepSpeed's schedulers left alone (iteration -1, then 0) give step 1 and 2 lr 0."""
    got = run(engine_like("WarmupDecayLR"), 1, 3)
    assert got[1] == got[2] == 0.0 and got[3] == pytest.approx(LR / W)


def test_a_resume_follows_the_new_schedule_from_its_first_step():
    """3 steps at train.steps=3, resumed at train.steps=6: the loaded optimizer holds the 3-step schedule's lr and
    the scheduler its iteration; align puts step 4 on the 6-step schedule."""
    old = engine_like("WarmupDecayLR", steps=3)
    schedule.align(old, 0)
    run(old, 1, 3)
    new = engine_like("WarmupDecayLR", steps=T)
    new.lr_scheduler.load_state_dict(old.lr_scheduler.state_dict())  # what load_checkpoint restores
    new.optimizer.param_groups[0]["lr"] = old.optimizer.param_groups[0]["lr"]
    schedule.align(new, 3)
    assert run(new, 4, T) == pytest.approx({k: expected("WarmupDecayLR", k) for k in range(4, T + 1)}, rel=1e-12)


def test_a_constant_lr_resume_puts_back_the_launched_lr():
    engine = engine_like("none")
    launched = schedule.group_lrs(engine)
    engine.optimizer.param_groups[0]["lr"] = 7e-4  # the saving run's, restored by the optimizer's load
    assert schedule.align(engine, 5, launched) == [LR] and run(engine, 6, 6) == {6: LR}


def test_the_start_up_line_names_what_changed():
    from harness.checkpoint.save import schedule_of

    saved = schedule_of(builder.build(recipe("WarmupDecayLR", steps=3)))
    here = schedule_of(builder.build(recipe("WarmupDecayLR", steps=T)))
    line = schedule.resume_line("global_step3", saved, here, 3, [2e-3])
    assert line == ("schedule differs from global_step3's (scheduler.total_num_steps 4 -> 7): steps 4 on follow this "
                    "launch's, step 4 at lr 0.002")
    assert schedule.resume_line("global_step3", here, here, 3, [2e-3]) is None
    assert schedule.resume_line("global_step3", None, here, 3, [2e-3]) is None  # a manifest from before


# --- on 2 ranks ----------------------------------------------------------------------------------------------------

SHORT, LONG = 3, 6
COMMON = ["--recipe", "zero2", "--set", "precision=fp32", "--set", "train.seq_len=64", "--set", "train.eval_every=0",
          "--set", "train.log_every=1", "--profile-steps", "", "--set", "train.model=tiny-llama",
          "--set", f"optimizer.lr={LR}", "--set", "batch.micro_batch_per_gpu=2", "--set", "batch.grad_accum_steps=1",
          "--set", "scheduler.type=WarmupDecayLR", "--set", "scheduler.warmup_steps=10"]


@pytest.fixture(scope="module")
def schedule_runs(tmp_path_factory):
    from helpers.launch import launch_jobs

    root = tmp_path_factory.mktemp("schedule")
    short, constant = root / "short", root / "constant"
    proc = launch_jobs([[*COMMON, "--set", f"train.steps={SHORT}", "--set", f"train.save_every={SHORT}",
                         "--output-dir", short],
                        [*COMMON, "--set", f"train.steps={LONG}", "--set", "train.save_every=0",
                         "--set", "scheduler.type=none", "--set", "optimizer.lr=1e-3", "--output-dir", constant,
                         "--resume", short / "checkpoints" / f"global_step{SHORT}"],
                        [*COMMON, "--set", f"train.steps={LONG}", "--set", "train.save_every=0",
                         "--output-dir", short, "--resume", "latest"]], root)
    return short, constant, proc


@pytest.mark.multirank
def test_logged_lrs_follow_the_convention_and_the_resumed_schedule(schedule_runs):
    from helpers.launch import job_output, records

    short, constant, proc = schedule_runs
    got = {r["step"]: r["lr"] for r in records(short, "train")}
    # warmup 10 clipped to the run: 3 steps (the first launch), then 6 (the resume)
    want = {k: expected("WarmupDecayLR", k, warmup=SHORT, total=SHORT) for k in range(1, SHORT + 1)}
    want |= {k: expected("WarmupDecayLR", k, warmup=LONG, total=LONG) for k in range(SHORT + 1, LONG + 1)}
    assert got == pytest.approx(want, rel=1e-9), got
    assert got[1] == pytest.approx(LR / SHORT) and got[SHORT + 1] == pytest.approx(LR * 4 / 6)
    said = job_output(proc.stdout, 2)
    assert (f"schedule differs from global_step{SHORT}'s (scheduler.total_num_steps 4 -> 7, scheduler.warmup_num_steps"
            f" 3 -> 6): steps 4 on follow this launch's, step 4 at lr 0.002") in said, said
    assert {r["step"]: r["lr"] for r in records(constant, "train")} == {k: 1e-3 for k in range(SHORT + 1, LONG + 1)}
    assert "optimizer.lr 0.003 -> 0.001, scheduler.total_num_steps 4 -> None" in job_output(proc.stdout, 1)
    manifest = json.loads((short / "checkpoints" / f"global_step{SHORT}" / "manifest.json").read_text())
    assert manifest["schedule"]["scheduler.type"] == "WarmupDecayLR"
