"""Real ranks on CPU: resume on another world size, preemption, atomic checkpoints under kill -9 (issue #10).

Launches are chained so each checks several things:
  zero2: U (2 ranks, 10 steps, uninterrupted) | P (2 ranks, SIGTERM to the launcher after step 2: checkpoint at
         the agreed step, P's steps equal U's) -> 2 ranks --resume latest (bitwise equal to U) -> 1 rank
         (2 -> 1, within 1e-5 of U) -> 2 ranks (1 -> 2, within 1e-5 of U)
  zero3: K (2 ranks, save every step, keep_last 2, kill -9 of rank 0 during a save: launcher non-zero within
         60 s, `latest` complete) -> 1 rank --resume latest (2 -> 1; the interrupted save skipped) -> 2 ranks
         (1 -> 2), both within 1e-5 of the uninterrupted trajectory (plain PyTorch, which 2 ranks match to 1e-7)
The global batch stays 8 throughout: 4 micro x 1 accum x 2 ranks, then 4 micro x 2 accum x 1 rank.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from helpers.baseline import plain_pytorch_losses
from helpers.launch import launch, losses, records, start
from helpers.reliability import (BETAS, COMMON, EVAL_FRACTION, LR, SEED, TOTAL, WD, assert_continues,
                                 latest_is_complete, rank_pid, steps, train_steps_logged, tree, wait_for)

pytestmark = pytest.mark.multirank

RTOL = 1e-5


@pytest.fixture(scope="module")
def zero2_straight(zero2_uninterrupted) -> dict[int, float]:
    return losses(zero2_uninterrupted)


def test_zero2_preempted_then_resumed_on_2_1_2_ranks(zero2_straight, tmp_path):
    run = tmp_path / "preempted"
    proc = start("--recipe", "zero2", "--output-dir", str(run), *COMMON, *steps(TOTAL), log=tmp_path / "p.log")
    wait_for(lambda: train_steps_logged(run) >= 2 or proc.poll() is not None, 300, "step 2", poll_s=0.05)
    launcher = next(p for p in tree(proc.pid) if "deepspeed.launcher.launch" in " ".join(p.cmdline()))
    everyone = tree(proc.pid)
    sent = time.monotonic()
    launcher.send_signal(signal.SIGTERM)  # it terminates rank 0's tree first: rank 1 learns through the store
    psutil.wait_procs(everyone, timeout=60)
    gone_s = time.monotonic() - sent
    log = (tmp_path / "p.log").read_text()
    assert not [p for p in everyone if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], log[-3000:]
    assert gone_s <= 40, f"processes still running {gone_s:.1f} s after SIGTERM"
    stopped = records(run, "preempted")
    assert len(stopped) == 1, log[-3000:]
    k = stopped[0]["step"]
    ckpt = run / "checkpoints"
    assert latest_is_complete(ckpt) == f"global_step{k}" and 3 <= k <= TOTAL - 3, f"stopped at {k}"
    assert losses(run) == {s: zero2_straight[s] for s in range(1, k + 1)}  # same ranks, same losses
    print(f"zero2: SIGTERM after step 2 -> checkpoint at step {k}; all processes gone {gone_s:.1f} s after it")

    launch("--recipe", "zero2", "--output-dir", str(run), "--resume", "latest", *COMMON, *steps(k + 1))
    assert losses(run)[k + 1] == zero2_straight[k + 1], "preemption resume is not exact"
    one = launch("--recipe", "zero2", "--output-dir", str(run), "--resume", "latest", *COMMON, *steps(k + 2),
                 ranks=1)
    assert "4 micro x 2 accum x 1 dp = 8 sequences" in one.stdout, one.stdout[-3000:]
    assert (ckpt / "universal" / f"global_step{k + 1}" / "converted.json").is_file()
    launch("--recipe", "zero2", "--output-dir", str(run), "--resume", "latest", *COMMON, *steps(TOTAL))
    after = {s: v for s, v in losses(run).items() if s > k + 1}
    worst = assert_continues(after, zero2_straight, RTOL)
    assert sorted(after) == list(range(k + 2, TOTAL + 1))
    assert not list(ckpt.glob("universal/.*")), "a conversion left its temporary folder"
    print(f"zero2 2 -> 1 -> 2 ranks: max relative loss difference vs the uninterrupted 2-rank run {worst:.2e}")


def save_in_progress(ckpt: Path, after: int) -> str | None:
    """A checkpoint folder after step `after` that has no manifest yet."""
    for folder in ckpt.glob("global_step*"):
        if int(folder.name[len("global_step"):]) > after and not (folder / "manifest.json").exists():
            return folder.name
    return None


def test_zero3_kill9_during_save_then_resumed_on_1_and_2_ranks(tmp_path):
    run = tmp_path / "killed"
    ckpt = run / "checkpoints"
    proc = start("--recipe", "zero3", "--output-dir", str(run), *COMMON, *steps(40), "--set", "train.save_every=1",
                 "--set", "train.keep_last=2", log=tmp_path / "k.log")
    wait_for(lambda: (ckpt / "global_step3" / "manifest.json").is_file() or proc.poll() is not None, 300,
             "the checkpoint of step 3", poll_s=0.05)
    victim = wait_for(lambda: rank_pid(proc.pid, 0), 10, "rank 0")
    caught = wait_for(lambda: save_in_progress(ckpt, 3), 60, "a save in progress", poll_s=0.002)
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    proc.wait(timeout=120)
    exit_s = time.monotonic() - killed
    assert proc.returncode != 0 and exit_s <= 60, f"launcher exit {proc.returncode} after {exit_s:.1f} s"
    tag = latest_is_complete(ckpt)
    complete = sorted(p.parent.name for p in ckpt.glob("global_step*/manifest.json"))
    assert len(complete) == 2 and tag in complete, f"keep_last 2 left {complete}"
    print(f"zero3: rank 0 killed while {caught} was being saved; launcher exit {proc.returncode} after "
          f"{exit_s:.1f} s; latest = {tag}; complete: {complete}")

    k = int(tag[len("global_step"):])
    want = plain_pytorch_losses(model="tiny-llama", steps=k + 4, seq_len=64, global_batch=8, lr=LR, betas=BETAS,
                                eps=1e-8, weight_decay=WD, clip=1.0, seed=SEED, eval_fraction=EVAL_FRACTION)
    want = {i + 1: v for i, v in enumerate(want)}
    assert_continues(losses(run), want, RTOL)  # the 2-rank steps before the kill
    interrupted = sorted(set(p.name for p in ckpt.glob("global_step*")) - set(complete))
    one = launch("--recipe", "zero3", "--output-dir", str(run), "--resume", "latest", *COMMON, *steps(k + 2),
                 "--set", "train.save_every=1", "--set", "train.keep_last=2", ranks=1)
    for name in interrupted:
        assert f"skipped {ckpt / name}: incomplete" in one.stdout, one.stdout[-3000:]
    launch("--recipe", "zero3", "--output-dir", str(run), "--resume", "latest", *COMMON, *steps(k + 4),
           "--set", "train.save_every=1", "--set", "train.keep_last=2")
    after = {s: v for s, v in losses(run).items() if s > k}
    assert sorted(after) == list(range(k + 1, k + 5))
    worst = assert_continues(after, want, RTOL)
    print(f"zero3 2 -> 1 -> 2 ranks: max relative loss difference vs the reference {worst:.2e}")


HANG = """
import time
from harness.dist import exit_now
from harness import dist as distmod
info = distmod.init(timeout_min=0.05)  # 3 s
if info.rank == 1:
    time.sleep(300)  # a hung peer: the test kills it once rank 0 has timed out
    exit_now(0)
start = time.monotonic()
try:
    distmod.mean_across_ranks([1.0]); distmod.barrier()
except Exception as e:
    assert distmod.is_timeout(e), e
    print(distmod.CollectiveTimeout(info.rank, 0.05, e, distmod.silent_peers(info.rank, 0.05)))
    print(f"waited {time.monotonic() - start:.1f} s")
# as harness/run.py ends: interpreter finalization with a timed-out gloo work can abort (-6), see exit_now
exit_now(0)
"""


def test_collective_timeout_ends_a_hung_collective_naming_the_setting():
    """Two real gloo ranks through harness.dist.init: rank 1 stops answering, rank 0's all-reduce fails
    after train.collective_timeout (3 s here) instead of waiting, with a message naming the setting and the peer."""
    import subprocess
    import sys

    from harness.dist import free_port
    from helpers.launch import ROOT, env

    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", HANG], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT,
                              env={**env(), "PYTHONPATH": str(ROOT), "RANK": str(r), "LOCAL_RANK": str(r),
                                   "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
             for r in (0, 1)]
    try:
        out0 = procs[0].communicate(timeout=180)[0]
    finally:
        procs[1].kill()  # still hung (it would sleep on): nothing more to learn from it
        procs[1].communicate(timeout=60)
    assert "rank 0: a collective did not complete within train.collective_timeout = 0.05 min; no answer from peer " \
           "rank 1 (127.0.0.1)" in out0, out0[-2000:]
    waited = float(out0.split("waited ")[1].split(" s")[0])
    assert procs[0].returncode == 0 and 2.5 <= waited <= 30, (procs[0].returncode, waited)
    print(f"hung peer: rank 0's all-reduce failed after {waited:.1f} s (collective_timeout 3 s)")
