"""rl.async (issue 46 item 7): generator processes of their own, one 2-rank launch of the built-in toy task on the
tiny Llama (tests/drivers/jobs.py):
- max_staleness 0 is the synchronous run: the same completions, the losses and grad norms within float32 noise (the
  generator's KV-cached log-probs against the trainer's full forward: ratios within 1e-5 of 1);
- ZeRO-3 (the weights gathered bucket by bucket collectively, then sent), max_staleness 2, weight_sync_steps 2: the
  rollouts' model_version is the schedule's (0, 0, 0, 2, 2), never older than the bound; the recorded importance
  ratios are the ones the loss used: the dapo loss recomputed from them and the recorded advantages equals the logged
  loss;
- truncated importance sampling (async_correction tis, cap 1.0): the recorded weights are capped at 1 and the logged
  loss is -sum(A w) / tokens;
- a generator process killed (SIGKILL, by this test) mid-run ends the run on both ranks with the reason, exit 1, no
  hang (the launch has a timeout).
Measured on the shared 2-core machine: the launch 102-184 s wall under load averages 12-19 (other engineers' tests).
The refusals, the two corrections (against formulas) and a silent generator (a real process that never answers:
rl.async_timeout_s ends the wait with the reason) run without ranks.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from harness.cli import main
from helpers.launch import job_output, launch_jobs, records as metric_records

BASE = {"train.model": "tiny-llama", "train.objective": "grpo", "precision": "fp32", "batch.micro_batch_per_gpu": 4,
        "batch.grad_accum_steps": 1, "batch.train_batch_size": '"auto"', "optimizer.type": "adamw",
        "optimizer.lr": 3e-2, "optimizer.weight_decay": 0, "scheduler.type": "none", "gradient_clipping": 1.0,
        "rl.num_generations": 4, "rl.max_completion_length": 8, "train.log_every": 1, "train.save_every": 0,
        "train.steps": 3}
ASYNC = {"rl.async": "true"}
CASES = {"sync": ("zero2", {}), "async0": ("zero2", {**ASYNC, "rl.max_staleness": 0}),
         "stale": ("zero3", {**ASYNC, "rl.max_staleness": 2, "rl.weight_sync_steps": 2, "train.steps": 5}),
         "tis": ("zero2", {**ASYNC, "rl.max_staleness": 1, "rl.async_correction": "tis",
                           "rl.vllm_importance_sampling_clip_max": 1.0}),
         "kill": ("zero2", {**ASYNC, "rl.max_staleness": 1, "train.steps": 200})}
KILLED = "kill"  # the last case: its generator processes are the only ones alive once its rollouts appear


def argv(root: Path, name: str) -> list[str]:
    recipe, sets = CASES[name]
    args = ["--recipe", recipe, "--output-dir", str(root / name), "--profile-steps", ""]
    for key, value in {**BASE, **sets}.items():
        args += ["--set", f"{key}={value}"]
    return args


def descendant(pid: int, ancestor: int) -> bool:
    while pid > 1:
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return False
        if pid == ancestor:
            return True
    return False


FORKSERVER = b"multiprocessing.forkserver"


def parent_cmdline(entry: Path) -> bytes:
    try:
        ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[1]
        return Path(f"/proc/{ppid}/cmdline").read_bytes()
    except (OSError, IndexError):
        return b""


def kill_a_generator(run: Path, done: threading.Event, killed: list) -> None:
    """Once the run's first rollouts are written, SIGKILL one generator process this test started."""
    while not done.is_set() and not (run / "rollouts.jsonl").exists():
        time.sleep(0.05)
    while not done.is_set() and not killed:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if FORKSERVER in cmdline and FORKSERVER in parent_cmdline(entry) and \
                    descendant(int(entry.name), os.getpid()):  # a generator: forked by the forkserver
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(int(entry.name))
                break
        time.sleep(0.05)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl_async")
    cases = [argv(root, name) for name in CASES if name != KILLED] + [{"argv": argv(root, KILLED), "code": 1}]
    done, killed = threading.Event(), []
    watcher = threading.Thread(target=kill_a_generator, args=(root / KILLED, done, killed), daemon=True)
    watcher.start()
    began = time.perf_counter()
    try:
        proc = launch_jobs(cases, root, ranks=2, timeout_s=600)
    finally:
        done.set()
        watcher.join()
    print(f"2-rank launch of {len(cases)} cases: {time.perf_counter() - began:.1f}s")
    return root, proc, killed


def rollouts(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]


def train_records(run: Path) -> list[dict]:
    return metric_records(run, "train")


@pytest.mark.multirank
def test_max_staleness_0_equals_the_synchronous_run(launched):
    root = launched[0]
    sync, async0 = train_records(root / "sync"), train_records(root / "async0")
    assert len(sync) == len(async0) == 3
    for a, b in zip(sync, async0):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-6), (a["loss"], b["loss"])
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5), (a["grad_norm"], b["grad_norm"])
        assert b["sample/staleness_mean"] == 0.0
    lines_sync, lines_async = rollouts(root / "sync"), rollouts(root / "async0")
    assert [r["completion_ids"] for r in lines_sync] == [r["completion_ids"] for r in lines_async]
    assert all(r["model_version"] == r["step"] - 1 for r in lines_async)
    ratios = [x for r in lines_async for x in r["importance_ratios"]]
    assert max(abs(x - 1) for x in ratios) < 1e-5
    assert len({tuple(r["completion_ids"]) for r in lines_sync}) > 1


def dapo_loss(lines: list[dict], eps: float = 0.2) -> float:
    """-min(r A, clip(r, 1 - eps, 1 + eps) A) summed over the step's tokens / their count (nothing truncated is
    masked: mask_truncated_completions false)."""
    total, count = 0.0, 0
    for r in lines:
        a = r["advantage"]
        for x in r["importance_ratios"]:
            total += -min(x * a, min(max(x, 1 - eps), 1 + eps) * a)
            count += 1
    return total / count


@pytest.mark.multirank
def test_staleness_respects_the_bound_and_the_recorded_ratios_are_the_losss(launched):
    run = launched[0] / "stale"
    lines, metrics = rollouts(run), train_records(run)
    versions = {r["step"]: r["model_version"] for r in lines}
    assert versions == {1: 0, 2: 0, 3: 0, 4: 2, 5: 2}  # synced at 0 and 2; asked up to 2 steps ahead
    assert all(r["step"] - 1 - r["model_version"] <= 2 for r in lines)
    for m in metrics:
        step_lines = [r for r in lines if r["step"] == m["step"]]
        assert len(step_lines) == 8 and all(len(r["importance_ratios"]) == len(r["sampling_logps"]) for r in step_lines)
        assert m["sample/staleness_mean"] == m["step"] - 1 - versions[m["step"]]
        assert m["loss"] == pytest.approx(dapo_loss(step_lines), abs=1e-6), m["step"]
        assert m["sample/dropped_stale_total"] == 0.0
    stale = [x for r in lines if r["step"] == 3 for x in r["importance_ratios"]]
    assert max(abs(x - 1) for x in stale) > 1e-3, "two steps of staleness left the ratios at 1"


@pytest.mark.multirank
def test_truncated_importance_sampling_weights_are_capped_and_are_the_losss(launched):
    run = launched[0] / "tis"
    lines = rollouts(run)
    weights = [x for r in lines for x in r["importance_ratios"]]
    assert max(weights) <= 1.0 and min(weights) < 0.999
    for m in train_records(run):
        step_lines = [r for r in lines if r["step"] == m["step"]]
        tokens = sum(len(r["importance_ratios"]) for r in step_lines)
        expected = -sum(r["advantage"] * x for r in step_lines for x in r["importance_ratios"]) / tokens
        assert m["loss"] == pytest.approx(expected, abs=1e-6)
        assert m["sampling/importance_sampling_ratio/max"] <= 1.0


@pytest.mark.multirank
def test_a_killed_generator_ends_the_run_on_every_rank_with_the_reason(launched):
    root, proc, killed = launched
    assert len(killed) == 1
    case = list(CASES).index(KILLED)
    err, out = job_output(proc.stderr, case), job_output(proc.stdout, case)
    reason = "rl.async's generator process (pid {}) failed: it exited with code -9 (killed by SIGKILL)".format(killed[0])
    assert "error (rank 1): rank " in err and reason in err, err[-3000:]  # rank 1 prints it, rank 0 says it
    assert "[fault]   rank " in out and reason in out, out[-3000:]
    steps = train_records(root / KILLED)
    assert len(steps) < 200


def _validate(tmp_path, rl: dict, capsys) -> str:
    recipe = {"description": "grpo", "train": {"objective": "grpo"}, "batch": {"micro_batch_per_gpu": 4},
              "rl": {"num_generations": 4, "async": True, **rl}}
    path = tmp_path / "recipe.json"
    path.write_text(json.dumps(recipe))
    assert main(["validate", str(path), "--world-size", "2"]) == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("rl,message", [
    ({"replay": "runs/x/rollouts.jsonl"}, "rl.async: rl.async with rl.replay 'runs/x/rollouts.jsonl'"),
    ({"num_iterations": 2}, "rl.num_iterations: rl.async with num_iterations 2"),
    ({"tools": ["tools.py:add"]}, "rl.async: rl.async with tools or an environment_factory"),
    ({"generator": "vllm"}, "rl.vllm_mode: rl.async with generator vllm and vllm_mode colocate"),
])
def test_what_async_does_not_combine_with_is_refused_before_launch(tmp_path, capsys, rl, message):
    err = _validate(tmp_path, rl, capsys)
    assert message in err and "fix:" in err, err


def test_the_corrections_against_the_sampling_logps_are_trls():
    """ppo_clip: per_token_loss's ratio taken to the sampler's log-probs (TRL's AsyncGRPO); tis: the ratio to the
    policy's own log-probs (1) and each token's loss weighted by the capped exp(logp - sampling_logp), detached."""
    import torch

    from harness.rl.loss import correction, per_token_loss

    rl = {"async_correction": "ppo_clip", "importance_sampling_level": "token", "vllm_importance_sampling_clip_max": 1.5,
          "epsilon": 0.2, "epsilon_high": None, "delta": None, "loss_type": "dapo", "beta": 0.0}
    logps = torch.tensor([[-1.0, -0.5, -0.5]], requires_grad=True)
    sampling = torch.tensor([[-1.1, -1.0, -0.5]])
    mask, adv = torch.ones(1, 3), torch.tensor([1.0])
    old, weight, used = correction(logps, sampling, mask, rl)
    r = torch.exp(logps.detach() - sampling)
    assert weight is None and torch.equal(old, sampling) and torch.allclose(used, r)
    loss, _, _ = per_token_loss(logps, old, None, adv, mask, rl)
    assert torch.allclose(loss, -torch.min(r, r.clamp(0.8, 1.2)))
    old, weight, used = correction(logps, sampling, mask, {**rl, "async_correction": "tis"})
    assert torch.equal(old, logps.detach()) and torch.allclose(weight, r.clamp(max=1.5)) and torch.equal(used, weight)
    assert not weight.requires_grad and float(weight.max()) == 1.5


def test_a_silent_generator_fails_the_step_after_async_timeout_s():
    """A generator process alive but sending nothing (here: a real process asleep) fails the wait after
    rl.async_timeout_s with the reason, not a hang; the death of one is named with its signal."""
    import multiprocessing as mp

    from harness.rl.async_rollouts import AsyncGeneration, ended

    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=time.sleep, args=(60,), daemon=True)
    proc.start()
    try:
        waiting = AsyncGeneration.__new__(AsyncGeneration)  # the schedule's state only: no engine, no weights
        waiting.timeout_s, waiting.failure, waiting.results, waiting.proc, waiting.conn, waiting.rank = \
            0.5, None, {}, proc, parent, 1
        began = time.monotonic()
        waiting._wait(3)
        assert 0.5 <= time.monotonic() - began < 10
        assert waiting.failure.startswith(f"rank 1: rl.async's generator process (pid {proc.pid}) failed: no "
                                          "rollouts for step 4 within rl.async_timeout_s = 0.5 s")
    finally:
        proc.kill()
        proc.join()
    assert ended(proc.exitcode) == "it exited with code -9 (killed by SIGKILL)"
