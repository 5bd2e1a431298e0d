"""The reliability runs' settings (2 ranks zero2/zero3 fp32, 8 rows per step) and the helpers that watch a
launch from outside: its process tree, its logged steps, its checkpoints."""

from __future__ import annotations

import json
import time
from pathlib import Path

import psutil

from helpers.launch import records

TOTAL = 10  # zero2 steps: room for the preempted run to stop anywhere in 3..7 and three resumes after it
# betas: the recipe default; with them DeepSpeed's CPU Adam kernel takes beta2^t from a running product that pow
# misses by 1 ulp at most steps from 6 on, so an exact resume there proves the product rebuilt (checkpoint/adam_powers)
SEED, LR, BETAS, WD, EVAL_FRACTION = 1234, 1e-3, (0.9, 0.95), 0.01, 0.02
COMMON = ["--set", "precision=fp32", "--set", "train.seq_len=64", "--set", "train.eval_every=0",
          "--set", "scheduler.type=none", "--set", f"optimizer.lr={LR}", "--set", f"optimizer.betas={list(BETAS)}",
          "--set", f"optimizer.weight_decay={WD}", "--set", "gradient_clipping=1.0",
          "--set", "batch.micro_batch_per_gpu=4", "--set", "batch.grad_accum_steps=1",
          "--set", f"train.eval_fraction={EVAL_FRACTION}", "--set", "train.log_every=1", "--profile-steps", ""]


def steps(n: int) -> list[str]:
    return ["--set", f"train.steps={n}"]


def assert_continues(got: dict[int, float], want: dict[int, float], rtol: float) -> float:
    assert got and set(got) <= set(want), f"steps {sorted(got)} outside the reference {sorted(want)}"
    worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in got)
    assert worst <= rtol, f"largest relative loss difference {worst:.3g} > {rtol}: {got} vs {want}"
    return worst


def tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def wait_for(predicate, timeout_s: float, what: str, poll_s: float = 0.01):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def train_steps_logged(run: Path) -> int:
    try:
        return max((r["step"] for r in records(run, "train")), default=0)
    except (FileNotFoundError, json.JSONDecodeError):
        return 0


def latest_is_complete(ckpt: Path) -> str:
    tag = (ckpt / "latest").read_text().strip()
    assert (ckpt / tag / "manifest.json").is_file(), f"latest names {tag}, which has no manifest"
    return tag


def rank_pid(launcher_pid: int, rank: int) -> int | None:
    for p in tree(launcher_pid):
        try:
            if f"--local_rank={rank}" in p.cmdline() and "harness/run.py" in p.cmdline():
                return p.pid
        except psutil.NoSuchProcess:
            pass
    return None
