"""Real ranks on CPU: resume on another world size, preemption, atomic checkpoints under kill -9 (issue #10).

Launches are chained so each checks several things:
  zero2: U (2 ranks, 10 steps, uninterrupted) | P (2 ranks, SIGTERM to the launcher after step 2: checkpoint at
         the agreed step, P's steps equal U's) -> 2 ranks --resume latest (bitwise equal to U) -> 1 rank
         (2 -> 1, within 1e-5 of U) -> 2 ranks (1 -> 2, within 1e-5 of U)
  zero3: K (2 ranks, save every step, keep_last 2, kill -9 of rank 0 during a save: launcher non-zero within
         60 s, `latest` complete) -> 1 rank --resume latest (2 -> 1; the interrupted save skipped) -> 2 ranks
         (1 -> 2), both within 1e-5 of the uninterrupted trajectory (plain PyTorch, which 2 ranks match to 1e-7)
The global batch stays 8 throughout: 4 micro x 1 accum x 2 ranks, then 4 micro x 2 accum x 1 rank.
P and K run first (the module's `chains` fixture); the resumes of both chains then share launches
(tests/drivers/jobs.py): zero2's 2-rank resume alone, one 1-rank launch for both 2 -> 1, one 2-rank launch for
both 1 -> 2 (7 launches -> 5).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from helpers.baseline import plain_pytorch_losses
from helpers.launch import job_output, launch, launch_jobs, losses, records, start
from helpers.reliability import (BETAS, COMMON, EVAL_FRACTION, LR, SEED, TOTAL, WD, assert_continues,
                                 latest_is_complete, rank_pid, steps, train_steps_logged, tree, wait_for)

pytestmark = pytest.mark.multirank

RTOL = 1e-5


@pytest.fixture(scope="module")
def zero2_straight(zero2_uninterrupted) -> dict[int, float]:
    return losses(zero2_uninterrupted)


def save_in_progress(ckpt: Path, after: int) -> str | None:
    """A checkpoint folder after step `after` that has no manifest yet."""
    for folder in ckpt.glob("global_step*"):
        if int(folder.name[len("global_step"):]) > after and not (folder / "manifest.json").exists():
            return folder.name
    return None


def preempt_zero2(run: Path, log: Path) -> dict:
    """P: SIGTERM to the launcher after step 2; what was left."""
    proc = start("--recipe", "zero2", "--output-dir", str(run), *COMMON, *steps(TOTAL), log=log)
    wait_for(lambda: train_steps_logged(run) >= 2 or proc.poll() is not None, 300, "step 2", poll_s=0.05)
    launcher = next(p for p in tree(proc.pid) if "deepspeed.launcher.launch" in " ".join(p.cmdline()))
    everyone = tree(proc.pid)
    sent = time.monotonic()
    launcher.send_signal(signal.SIGTERM)  # it terminates rank 0's tree first: rank 1 learns through the store
    psutil.wait_procs(everyone, timeout=60)
    gone_s = time.monotonic() - sent
    left = [p for p in everyone if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    return {"gone_s": gone_s, "left": left, "stopped": records(run, "preempted"), "losses": losses(run),
            "latest": latest_or_why(run / "checkpoints")}


def latest_or_why(ckpt: Path):
    """latest_is_complete now (the resumes save more), or the AssertionError it raised, for the test to raise."""
    try:
        return latest_is_complete(ckpt)
    except (AssertionError, OSError) as e:
        return e


def checked(value):
    if isinstance(value, Exception):
        raise value
    return value


def kill_zero3_during_save(run: Path, log: Path) -> dict:
    """K: save every step, keep_last 2; rank 0 killed with SIGKILL while a save after step 3 is in progress."""
    ckpt = run / "checkpoints"
    proc = start("--recipe", "zero3", "--output-dir", str(run), *COMMON, *steps(40), *ZERO3_SAVES, log=log)
    wait_for(lambda: (ckpt / "global_step3" / "manifest.json").is_file() or proc.poll() is not None, 300,
             "the checkpoint of step 3", poll_s=0.05)
    victim = wait_for(lambda: rank_pid(proc.pid, 0), 10, "rank 0")
    caught = wait_for(lambda: save_in_progress(ckpt, 3), 60, "a save in progress", poll_s=0.002)
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    proc.wait(timeout=120)
    exit_s = time.monotonic() - killed
    latest = latest_or_why(ckpt)
    complete = sorted(p.parent.name for p in ckpt.glob("global_step*/manifest.json"))
    interrupted = sorted(set(p.name for p in ckpt.glob("global_step*")) - set(complete))
    return {"caught": caught, "code": proc.returncode, "exit_s": exit_s, "latest": latest, "complete": complete,
            "interrupted": interrupted, "losses": losses(run)}


ZERO3_SAVES = ["--set", "train.save_every=1", "--set", "train.keep_last=2"]


@pytest.fixture(scope="module")
def chains(zero2_straight, tmp_path_factory) -> dict:
    """Both chains of the module docstring, their resumes sharing launches (tests/drivers/jobs.py): the zero2
    2-rank resume alone (its exactness), then ONE 1-rank launch (zero2's and zero3's 2 -> 1), then ONE 2-rank
    launch (both 1 -> 2). A chain whose interruption did not leave what its resumes need goes no further: its
    test reports why."""
    root = tmp_path_factory.mktemp("chains")
    z2, z3 = root / "preempted", root / "killed"
    out = {"z2": z2, "z3": z3, "p": preempt_zero2(z2, root / "p.log"), "k": kill_zero3_during_save(z3, root / "k.log")}
    out["p_log"], out["k_log"] = (root / "p.log").read_text(), (root / "k.log").read_text()
    stopped = out["p"]["stopped"]
    k2 = stopped[0]["step"] if len(stopped) == 1 else None
    latest = out["k"]["latest"]
    k3 = None if isinstance(latest, Exception) else int(latest[len("global_step"):])
    if k2 is not None:
        launch("--recipe", "zero2", "--output-dir", str(z2), "--resume", "latest", *COMMON, *steps(k2 + 1))
    one, two = [], []  # (chain, argv)
    if k2 is not None:
        one.append(("z2", ["--recipe", "zero2", "--output-dir", z2, "--resume", "latest", *COMMON, *steps(k2 + 2)]))
        two.append(("z2", ["--recipe", "zero2", "--output-dir", z2, "--resume", "latest", *COMMON, *steps(TOTAL)]))
    if k3 is not None:
        one.append(("z3", ["--recipe", "zero3", "--output-dir", z3, "--resume", "latest", *COMMON, *steps(k3 + 2),
                           *ZERO3_SAVES]))
        two.append(("z3", ["--recipe", "zero3", "--output-dir", z3, "--resume", "latest", *COMMON, *steps(k3 + 4),
                           *ZERO3_SAVES]))
    for ranks, jobs in ((1, one), (2, two)):
        if jobs:
            (root / str(ranks)).mkdir()
            proc = launch_jobs([argv for _, argv in jobs], root / str(ranks), ranks=ranks)
            for i, (chain, _) in enumerate(jobs):
                out[f"{chain}_{ranks}rank_stdout"] = job_output(proc.stdout, i)
        if ranks == 1 and k2 is not None:  # before the 1 -> 2 resume converts again
            out["z2_converted"] = (z2 / "checkpoints" / "universal" / f"global_step{k2 + 1}" / "converted.json").is_file()
    return out


def test_zero2_preempted_then_resumed_on_2_1_2_ranks(zero2_straight, chains):
    run, p, log = chains["z2"], chains["p"], chains["p_log"]
    gone_s = p["gone_s"]
    assert not p["left"], log[-3000:]
    assert gone_s <= 40, f"processes still running {gone_s:.1f} s after SIGTERM"
    stopped = p["stopped"]
    assert len(stopped) == 1, log[-3000:]
    k = stopped[0]["step"]
    ckpt = run / "checkpoints"
    assert checked(p["latest"]) == f"global_step{k}" and 3 <= k <= TOTAL - 3, f"stopped at {k}"
    assert p["losses"] == {s: zero2_straight[s] for s in range(1, k + 1)}  # same ranks, same losses
    print(f"zero2: SIGTERM after step 2 -> checkpoint at step {k}; all processes gone {gone_s:.1f} s after it")

    # the resumes (chains): 2 ranks to k + 1, then 1 rank to k + 2, then 2 ranks to TOTAL
    assert losses(run)[k + 1] == zero2_straight[k + 1], "preemption resume is not exact"
    one = chains["z2_1rank_stdout"]
    assert "4 micro x 2 accum x 1 dp = 8 sequences" in one, one[-3000:]
    assert chains["z2_converted"]
    after = {s: v for s, v in losses(run).items() if s > k + 1}
    worst = assert_continues(after, zero2_straight, RTOL)
    assert sorted(after) == list(range(k + 2, TOTAL + 1))
    assert not list(ckpt.glob("universal/.*")), "a conversion left its temporary folder"
    print(f"zero2 2 -> 1 -> 2 ranks: max relative loss difference vs the uninterrupted 2-rank run {worst:.2e}")


def test_zero3_kill9_during_save_then_resumed_on_1_and_2_ranks(chains):
    run, kill = chains["z3"], chains["k"]
    ckpt = run / "checkpoints"
    exit_s = kill["exit_s"]
    assert kill["code"] != 0 and exit_s <= 60, f"launcher exit {kill['code']} after {exit_s:.1f} s"
    tag, complete = checked(kill["latest"]), kill["complete"]
    assert len(complete) == 2 and tag in complete, f"keep_last 2 left {complete}"
    print(f"zero3: rank 0 killed while {kill['caught']} was being saved; launcher exit {kill['code']} after "
          f"{exit_s:.1f} s; latest = {tag}; complete: {complete}")

    k = int(tag[len("global_step"):])
    want = plain_pytorch_losses(model="tiny-llama", steps=k + 4, seq_len=64, global_batch=8, lr=LR, betas=BETAS,
                                eps=1e-8, weight_decay=WD, clip=1.0, seed=SEED, eval_fraction=EVAL_FRACTION)
    want = {i + 1: v for i, v in enumerate(want)}
    assert_continues(kill["losses"], want, RTOL)  # the 2-rank steps before the kill
    # the resumes (chains): 1 rank to k + 2, then 2 ranks to k + 4
    one = chains["z3_1rank_stdout"]
    for name in kill["interrupted"]:
        assert f"skipped {ckpt / name}: incomplete" in one, one[-3000:]
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


@pytest.mark.parametrize("text", ["[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Timed out waiting 3000ms for "
                                  "recv operation to complete",
                                  "Application timeout caused pair closure"])  # gloo's texts (libtorch_cpu.so)
def test_both_of_gloos_timeout_texts_are_collective_timeouts(text):
    """The op that timed out says 'Timed out waiting'; an async op still pending on the closed pair (a ZeRO-3
    prefetch's all-gather, waited on in the next module's forward) says 'Application timeout caused pair closure':
    tests/test_two_hosts.py's link-down case met the second, which was not named as the timeout it is."""
    from harness import dist as distmod

    assert distmod.is_timeout(RuntimeError(text)) and not distmod.is_timeout(RuntimeError("Connection reset by peer"))
