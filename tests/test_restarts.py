"""`harness launch --max-restarts N` (issue #25): a failed attempt is stopped whole and started again in the same run
folder from its latest complete checkpoint (harness/commands/launch.py, harness/train/restarts.py).

Real ranks (2 CPU ranks, zero2 fp32, the built-in tiny Llama), each rank killed from outside with SIGKILL by the
test, as the OOM killer or a crashed node would:
  U  10 steps uninterrupted (deepspeed directly; conftest's zero2_uninterrupted, shared with test_reliability);
  R  the same, with checkpoints every 3 steps, under `harness launch --max-restarts 3` with no --output-dir (rank 0
     picks the folder, the restarts must keep it): rank 1 killed at step 1, before any checkpoint (restart from the
     start, in the same folder), then rank 0 killed as global_step3 completes (restart with --resume latest), then
     rank 1 as global_step6, saved by that resumed attempt, completes (resumed again). R ends with U's losses at
     every step and U's checkpoint, model and optimizer states, bit for bit (issue #33 part 4: DeepSpeed's CPU Adam
     kernel's running beta powers, rebuilt at each load by harness/checkpoint/adam_powers.py; resuming at step 6
     with betas 0.9/0.95 changes the bias corrections of steps 7..9 without it); restarts.jsonl has the three
     restarts, report.md shows them;
  exit 75 (SIGTERM to one rank: preempted with a checkpoint) and exit 2 (bad input) come back at once with
  restarts left; with --max-restarts 1 a second failure is returned as it is.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from harness.commands import launch as launchmod
from harness.dist import free_port
from harness.report.restarts import restarts_line, restarts_section
from harness.train import restarts
from harness.train.metrics import drop_partial_line
from helpers.launch import ROOT, env, losses, records
from helpers.reliability import COMMON, TOTAL, rank_pid, steps, train_steps_logged, wait_for

HARNESS = Path(sys.executable).parent / "harness"
SAVE = 3  # resumes at steps 3 and 6: the second from a checkpoint a resumed attempt wrote
RUN_ARGS = ["--recipe", "zero2", *COMMON, *steps(TOTAL), "--set", f"train.save_every={SAVE}"]


# --- pure parts: flags, restart arguments, why an attempt failed, the report's lines ---

@pytest.mark.parametrize("argv, said", [
    (["--max-restarts", "-1", "--num_gpus", "2", "harness/run.py"], "--max-restarts -1: not a whole number >= 0"),
    (["--max-restarts=two", "harness/run.py"], "--max-restarts two: not a whole number >= 0"),
    (["--max-restarts"], "--max-restarts: needs a value"),
    (["--max-restarts", "1", "--restart-backoff", "-1", "harness/run.py"],
     "--restart-backoff -1: not a number of seconds >= 0"),
    (["--num_gpus", "2", "--max-restarts", "3", "harness/run.py"], "own option and goes first"),
    (["--max-restarts", "3", "--num_gpus", "2", "bench/time_model.py"], "bench/time_model.py is not harness/run.py"),
])
def test_bad_restart_flags_exit_2_before_anything_starts(argv, said, capsys):
    assert launchmod.main(argv) == 2
    err = capsys.readouterr().err
    assert said in err and "fix:" in err and "Traceback" not in err, err


def test_max_restarts_is_not_passed_to_deepspeed_and_help_names_it(capsys):
    opts, rest = launchmod.parse_own(["--max-restarts", "3", "--restart-backoff=0.5", "--num_gpus", "2",
                                      "harness/run.py", "--recipe", "zero2"])
    assert (opts.max_restarts, opts.backoff_s) == (3, 0.5)
    assert rest == ["--num_gpus", "2", "harness/run.py", "--recipe", "zero2"]
    cmd = launchmod.split_command(rest)
    assert (cmd.head, cmd.script, cmd.script_args) == (["--num_gpus", "2"], "harness/run.py", ["--recipe", "zero2"])
    assert launchmod.main(["--help"]) == 0
    assert "--max-restarts N" in capsys.readouterr().out


def _checkpoint(run: Path, step: int, complete: bool) -> None:
    folder = run / "checkpoints" / f"global_step{step}"
    folder.mkdir(parents=True)
    if complete:
        (folder / "manifest.json").write_text(json.dumps({"step": step}))


def test_restart_arguments_pin_the_folder_and_resume_the_newest_complete_checkpoint(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    given = ["--recipe", "zero2", "--overwrite", "--set", "train.steps=10"]
    assert restarts.restart_args(given, None) == (given, None)  # no folder yet: the same command again
    # no complete checkpoint: from the start, in this folder (--overwrite clears the failed attempt's outputs)
    _checkpoint(run, 2, complete=False)
    assert restarts.restart_args(given, run) == (
        ["--recipe", "zero2", "--set", "train.steps=10", "--output-dir", str(run), "--overwrite"], None)
    # ... unless the command resumes another run's checkpoint: that again
    assert restarts.restart_args(["--resume", "/x/checkpoints/global_step3"], run)[0] == [
        "--resume", "/x/checkpoints/global_step3", "--output-dir", str(run)]
    # a complete one: --resume latest, never --overwrite (abbreviated too), an interrupted newer save skipped
    _checkpoint(run, 4, complete=True)
    _checkpoint(run, 6, complete=False)
    args, tag = restarts.restart_args(["--output-dir", "elsewhere", "--overw", "--resume", "/x/global_step3"], run)
    assert tag == "global_step4"
    assert args == ["--output-dir", "elsewhere", "--resume", "/x/global_step3", "--output-dir", str(run),
                    "--resume", "latest"]
    from harness.train.run_args import parse

    parsed = parse(args)  # argparse: the last occurrence wins
    assert (parsed.output_dir, parsed.resume, parsed.overwrite) == (str(run), "latest", False)


def test_why_an_attempt_failed_names_each_rank_and_the_signal(tmp_path, monkeypatch):
    from harness.dist import Launch
    from harness.train.preempt import EXIT_DIR_ENV, report_exit

    monkeypatch.setenv(EXIT_DIR_ENV, str(tmp_path))
    report_exit(1, Launch(world_size=2, local_size=2, rank=1))  # rank 0 was killed: no report
    codes = launchmod.rank_codes(tmp_path)
    assert codes == {"0": None, "1": 1}
    assert launchmod.describe(codes, 247) == ("rank 0 left no exit report (killed), rank 1 exited 1, "
                                               "launcher exit 247 (a rank ended by SIGKILL)")
    assert launchmod.describe({}, 1) == "launcher exit 1"


def test_a_signal_during_the_backoff_cancels_the_restart():
    start = time.monotonic()
    assert launchmod.backoff(30, pending=[signal.SIGTERM]) is False and time.monotonic() - start < 1
    assert launchmod.backoff(0.05, pending=[]) is True


def test_report_lines_for_restarts():
    records_ = [{"attempt": 1, "time": 0.0, "code": 247, "reason": "rank 1 left no exit report (killed)",
                 "backoff_s": 1.0, "resume_from": None},
                {"attempt": 2, "time": 60.0, "code": 1, "reason": "rank 0 exited 1", "backoff_s": 2.0,
                 "resume_from": "global_step4"}]
    assert restarts_line(records_) == ["- restarts: 2 (harness launch --max-restarts), resumed from the start, "
                                       "global_step4"]
    text = "\n".join(restarts_section(records_))
    assert "| 2 | 1970-01-01 00:01:00 UTC | 1 | rank 0 exited 1 | 2 | global_step4 |" in text
    assert restarts_line([]) == restarts_section([]) == []


def test_a_line_cut_by_a_kill_is_dropped_before_appending(tmp_path):
    path = tmp_path / "metrics.jsonl"
    for content, kept in [(b"", b""), (b'{"a": 1}\n', b'{"a": 1}\n'), (b'{"a": 1}\n{"b":', b'{"a": 1}\n'),
                          (b'{"b":', b""), (b'{"a": 1}\n' + b"x" * 200_000, b'{"a": 1}\n')]:
        path.write_bytes(content)
        drop_partial_line(path)
        assert path.read_bytes() == kept


# --- real ranks ---

def start(cmd: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(cmd, cwd=ROOT, env={**env(), "PYTHONPATH": str(ROOT)}, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def harness_launch(*args: str, max_restarts: int, ranks: int = 2) -> list[str]:
    return [str(HARNESS), "launch", "--max-restarts", str(max_restarts), "--restart-backoff", "0.2",
            "--master_port", str(free_port()), "--num_gpus", str(ranks), "harness/run.py", *args]


def until(proc: subprocess.Popen, log: Path, predicate, what: str, timeout_s: float = 300):
    """wait_for, failing at once (with the log) if the launch ends first."""
    value = wait_for(lambda: predicate() or proc.poll() is not None, timeout_s, what, poll_s=0.02)
    assert proc.poll() is None, f"the launch ended (exit {proc.returncode}) before {what}\n{log.read_text()[-4000:]}"
    return value


def kill_rank(proc: subprocess.Popen, log: Path, rank: int) -> None:
    os.kill(until(proc, log, lambda: rank_pid(proc.pid, rank), f"rank {rank}"), signal.SIGKILL)


def tensors(obj, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor in a loaded checkpoint file, by its path in the nested dicts and lists."""
    if torch.is_tensor(obj):
        return {prefix: obj}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    return {k: v for key, value in items for k, v in tensors(value, f"{prefix}/{key}").items()}


def states(run: Path) -> dict[str, torch.Tensor]:
    step = run / "checkpoints" / f"global_step{TOTAL}"
    files = sorted(step.glob("*model_states.pt")) + sorted(step.glob("*optim_states.pt"))
    return {f"{f.name}{k}": v for f in files
            for k, v in tensors(torch.load(f, map_location="cpu", weights_only=False)).items()}


def kill_when(proc: subprocess.Popen, log: Path, rank: int, ready, what: str) -> None:
    """SIGKILL `rank` of the running attempt the moment `ready()` holds (its pid looked up before, so no step
    passes between the two)."""
    pid = until(proc, log, lambda: rank_pid(proc.pid, rank), f"rank {rank}")
    until(proc, log, ready, what)
    os.kill(pid, signal.SIGKILL)


def complete(run: Path, step: int) -> bool:
    return (run / "checkpoints" / f"global_step{step}" / "manifest.json").is_file()


def unequal_losses(got: dict[int, float], want: dict[int, float]) -> list[str]:
    return [f"step {s}: {got.get(s, float('nan')).hex()} != {want[s].hex()}" for s in sorted(want)
            if got.get(s) != want[s]] + [f"step {s} not in the reference" for s in sorted(set(got) - set(want))]


@pytest.mark.multirank
def test_killed_three_times_restarts_in_the_same_folder_and_ends_bitwise_equal(zero2_uninterrupted, tmp_path):
    straight = zero2_uninterrupted  # the same arguments, checkpoints only at the end
    out, log = tmp_path / "runs", tmp_path / "r.log"
    proc = start(harness_launch(*RUN_ARGS, "--set", f"train.output_dir={out}", max_restarts=3), log)
    began = time.monotonic()
    try:
        run = until(proc, log, lambda: next(out.glob("*_zero2"), None), "the run folder")
        until(proc, log, lambda: train_steps_logged(run) >= 1, "step 1")
        kill_rank(proc, log, 1)  # before the first checkpoint: the restart starts over
        until(proc, log, lambda: len(restarts.read(run)) == 1, "the first restart")
        kill_when(proc, log, 0, lambda: complete(run, SAVE), f"a complete global_step{SAVE}")
        until(proc, log, lambda: len(restarts.read(run)) == 2, "the second restart")
        kill_when(proc, log, 1, lambda: complete(run, 2 * SAVE), f"a complete global_step{2 * SAVE}")
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    took_s = time.monotonic() - began
    text = log.read_text()
    assert proc.returncode == 0, text[-4000:]
    assert [p.name for p in out.iterdir()] == [run.name], "a restart started another run folder"

    first, second, third = restarts.read(run)
    assert (first["attempt"], first["resume_from"], first["exit_codes"]["1"]) == (1, None, None), first
    assert "--overwrite" in first["script_args"] and "rank 1 left no exit report (killed)" in first["reason"]
    assert second["attempt"] == 2 and second["exit_codes"]["0"] is None, second
    assert (second["resume_from"], third["resume_from"]) == (f"global_step{SAVE}", f"global_step{2 * SAVE}"), third
    for later in (second, third):
        assert later["script_args"][-2:] == ["--resume", "latest"] and "--overwrite" not in later["script_args"]
    assert "[restart] attempt 3 failed" in text and "restart 3/3" in text

    unequal = unequal_losses(losses(run), losses(straight))
    assert not unequal, f"the restarted run's losses differ from the uninterrupted run's: {unequal}"
    assert sorted(r["step"] for r in records(run, "checkpoint"))[-1] == TOTAL
    want, got = states(straight), states(run)
    assert got.keys() == want.keys() and want
    unequal = [k for k in want if not torch.equal(want[k], got[k])]
    assert not unequal, f"not bit for bit equal: {len(unequal)} of {len(want)} tensors, {unequal[:5]}"

    from harness.report import write_report

    report = write_report(run).read_text()
    assert f"- restarts: 3 (harness launch --max-restarts), resumed from the start, global_step{SAVE}, " \
           f"global_step{2 * SAVE}" in report and "## Restarts" in report
    print(f"killed at step 1 and as global_step{SAVE} and global_step{2 * SAVE} completed: 3 restarts, losses of "
          f"{len(losses(run))} steps and {len(want)} tensors equal bit for bit, {took_s:.0f} s")


@pytest.mark.multirank
def test_preempted_and_bad_input_are_returned_at_once_not_restarted(tmp_path):
    run, log = tmp_path / "run", tmp_path / "p.log"
    proc = start(harness_launch(*RUN_ARGS, "--output-dir", str(run), max_restarts=3), log)
    try:
        until(proc, log, lambda: train_steps_logged(run) >= 2, "step 2")
        os.kill(until(proc, log, lambda: rank_pid(proc.pid, 0), "rank 0"), signal.SIGTERM)  # as Slurm --signal
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert proc.returncode == 75 and len(records(run, "preempted")) == 1, text[-4000:]
    assert "[restart]" not in text and not restarts.read(run)

    bad = subprocess.run(harness_launch("--recipe", "no_such_recipe", "--output-dir", str(tmp_path / "bad"),
                                        max_restarts=3, ranks=1), cwd=ROOT, env={**env(), "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=300)
    said = bad.stdout + bad.stderr
    assert bad.returncode == 2 and "no_such_recipe" in said and "[restart]" not in said, said[-4000:]


@pytest.mark.multirank
def test_restarts_used_up_return_the_last_failure(tmp_path):
    """Both attempts lose rank 1 while it starts, before any run folder exists: the restart is the same command,
    and after the second failure the launch ends with that attempt's code."""
    log = tmp_path / "x.log"
    proc = start(harness_launch(*RUN_ARGS, "--output-dir", str(tmp_path / "run"), max_restarts=1), log)
    killed: set[int] = set()
    try:
        while len(killed) < 2 and proc.poll() is None:
            pid = rank_pid(proc.pid, 1)
            if pid and pid not in killed:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            time.sleep(0.02)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert len(killed) == 2, text[-4000:]
    assert "restart 1/1" in text and f"--max-restarts 1 used up: exit {proc.returncode}" in text, text[-4000:]
    assert proc.returncode not in (0, 2, 75) and text.count("SIGKILL") >= 2, text[-4000:]
