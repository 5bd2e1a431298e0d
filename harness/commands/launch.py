"""`harness launch [deepspeed options] harness/run.py ...`: DeepSpeed's own `deepspeed` command, made safe to signal.

The `deepspeed` command (launcher/runner.py) has no signal handler on one node: SIGTERM ends it at once while
its per-node launcher and the ranks go on to save, so whatever waits on it (a container runtime, a job step, a
CI runner) tears the ranks down mid-save; as a container's PID 1 it ignores SIGTERM altogether. This wrapper:
  - starts the runner (same arguments, same environment) in a process group of its own, through
    harness/commands/deepspeed_runner.py (the runner and its node's launcher start as ranks do: quick_start);
  - forwards SIGTERM, SIGUSR1 and SIGINT to that whole group, so every rank gets the signal at once (they
    agree on a step, save and exit 75: harness/train/preempt.py);
  - waits until every process of the tree is gone: it is a child subreaper (Linux), so the launcher and
    ranks that outlive the runner become its children, and as a container's PID 1 it reaps what reparents to it;
  - exits with the ranks' code: each rank writes its exit code into a folder named by DSHARNESS_EXIT_DIR
    (the launcher exits 1 after a signal whatever its ranks return). A failing rank's code wins (the first
    to fail), then 75 if any rank was preempted, then 0 when every local rank reported 0; with no report
    (ranks on other nodes started over ssh, or killed before writing one) the runner's own code.
With `--max-restarts N` a failed attempt (any code but 0, 2 bad input, 3 numeric fault and 75 preempted, and no signal forwarded:
a rank that died, a collective that timed out, a served teacher's outage, 69) is ended whole (SIGTERM to the group,
SIGKILL after a grace period, every process reaped), and after a backoff (doubling, capped) harness/run.py starts again in the same run
folder from its latest complete checkpoint (harness/train/restarts.py), up to N times; each restart is a line in
RUN/restarts.jsonl. Exhausted, it returns the last attempt's code.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from harness.commands import deepspeed_runner
from harness.dist import slurm_step
from harness.errors import ConfigError, UsageError, without_secrets
from harness.log import say
from harness.ops import pin_cpu_accelerator
from harness.startup import quick_start
from harness.train import restarts
from harness.train.preempt import EXIT_DIR_ENV, EXIT_NUMERIC_FAULT, EXIT_PREEMPTED

FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>
EXIT_BAD_INPUT = 2
NOT_RESTARTED = (0, EXIT_BAD_INPUT, EXIT_PREEMPTED, EXIT_NUMERIC_FAULT)  # a fault: the same batch again
BACKOFF_CAP_S = 60.0
STOP_GRACE_S = 30.0  # what DeepSpeed's launcher gives each rank's tree between SIGTERM and SIGKILL
USAGE = ("usage: harness launch [--max-restarts N] [--restart-backoff S] [--dry-run] [deepspeed options] SCRIPT "
         "[script args]\n"
         "  e.g. harness launch --max-restarts 3 --num_gpus 8 harness/run.py --recipe zero3\n"
         "The arguments after harness's own are DeepSpeed's `deepspeed` command's (deepspeed --help);\n"
         "SIGTERM/SIGUSR1/SIGINT to this process reach every rank, it returns once every process is gone, with the\n"
         "ranks' exit code (75: preempted with a checkpoint, --resume latest continues).\n"
         "  --max-restarts N     when a rank dies or a collective times out (any exit but 0, 2 bad input, 75\n"
         "                       preempted), stop every rank and start harness/run.py again in the same run folder\n"
         "                       from its latest checkpoint, up to N times (default 0); logged in RUN/restarts.jsonl\n"
         f"  --restart-backoff S  seconds before the first restart, doubled for each next one up to "
         f"{BACKOFF_CAP_S:.0f} (default 1)\n"
         "  --dry-run            check harness/run.py's arguments as its ranks would, for the world the launch would\n"
         "                       start (recipe, overrides, batch, model, data, this machine), and start nothing\n"
         "                       (harness/commands/launch_check.py)")
OWN_FLAGS = ("--max-restarts", "--restart-backoff", "--dry-run")


@dataclass
class Options:
    max_restarts: int = 0
    backoff_s: float = 1.0
    dry_run: bool = False


@dataclass
class Command:
    """`deepspeed` arguments split where the script starts (DeepSpeed's own parser decides)."""
    head: list[str]
    script: str
    script_args: list[str]


def _value(name: str, text: str) -> int | float:
    try:
        value = int(text) if name == "--max-restarts" else float(text)
    except ValueError:
        value = -1
    if not 0 <= value < float("inf"):
        kind = "a whole number" if name == "--max-restarts" else "a number of seconds"
        raise UsageError(f"harness launch {name} {text}: not {kind} >= 0\n"
                         f"    fix: e.g. harness launch {name} {3 if name == '--max-restarts' else 1} --num_gpus 2 "
                         "harness/run.py ...")
    return value


def parse_own(argv: list[str]) -> tuple[Options, list[str]]:
    """harness launch's own options, which lead; the rest goes to `deepspeed` untouched."""
    opts, i = Options(), 0
    while i < len(argv) and argv[i].partition("=")[0] in OWN_FLAGS:
        name, eq, text = argv[i].partition("=")
        if name == "--dry-run":
            opts.dry_run, i = True, i + 1
            continue
        if not eq:
            if i + 1 == len(argv):
                raise UsageError(f"harness launch {name}: needs a value\n    fix: e.g. {name} 3")
            i, text = i + 1, argv[i + 1]
        if name == "--max-restarts":
            opts.max_restarts = int(_value(name, text))
        else:
            opts.backoff_s = float(_value(name, text))
        i += 1
    rest = argv[i:]
    late = next((a for a in rest if a.partition("=")[0] in OWN_FLAGS), None)
    if late:
        raise UsageError(f"harness launch: {late.partition('=')[0]} is harness launch's own option and goes first, "
                         "before DeepSpeed's\n    fix: harness launch --max-restarts N --num_gpus 2 harness/run.py ...")
    return opts, rest


def split_command(argv: list[str], flag: str = "--max-restarts",
                  why: str = "a restart continues harness/run.py from its latest checkpoint") -> Command:
    """Where SCRIPT starts, by DeepSpeed's parser (its flags take values or not); restarts need harness/run.py."""
    pin_cpu_accelerator()  # before DeepSpeed is imported, as in the runner (harness/commands/deepspeed_runner.py)
    quick_start()
    from deepspeed.launcher.runner import parse_args

    argv0, sys.argv[0] = sys.argv[0], deepspeed_runner.PROG  # its usage names `harness launch`, not `harness`
    try:
        parsed = parse_args(argv)  # bad DeepSpeed arguments: its usage message and SystemExit(2)
    finally:
        sys.argv[0] = argv0
    cut = len(argv) - len(parsed.user_args) - 1
    script = argv[cut]
    if not ((parsed.module and script == "harness.run") or Path(script).parts[-2:] == ("harness", "run.py")):
        raise UsageError(f"harness launch {flag}: {script} is not harness/run.py; {why}\n"
                         f"    fix: launch harness/run.py, or drop {flag}")
    return Command(argv[:cut], script, argv[cut + 1:])


def check_slurm_step(argv: list[str]) -> None:
    """In a Slurm step of several tasks, each task running `harness launch` is a launcher of its own: without a
    node rank each would start a whole world whose first rank is rank 0 (TRL#2605's "every process is rank 0
    of 1"), all writing the same run folder. One task per node with --node_rank is how it works."""
    step = slurm_step()
    if step is None or step.num_tasks == 1:
        return
    flags = {a.partition("=")[0] for a in argv}
    fix = ("    fix: one task per node (srun --ntasks-per-node=1) running harness launch --hostfile FILE --no_ssh "
           "--node_rank $SLURM_NODEID --master_addr NODE0 --master_port P, as the batch script of `harness slurm` "
           "does (docs/slurm.md); or let srun start the ranks themselves: srun --ntasks-per-node=G python "
           "harness/run.py ... (the ranks read SLURM_PROCID)")
    if step.num_tasks > step.num_nodes:
        raise UsageError(f"harness launch: one of {step.num_tasks} tasks of Slurm job {step.job_id}'s step on "
                         f"{step.num_nodes} node(s): more than one launcher per node would start the ranks twice\n"
                         + fix)
    if "--node_rank" not in flags:
        raise UsageError(f"harness launch: task {step.proc_id} of {step.num_tasks} of a Slurm step (job "
                         f"{step.job_id}) without --node_rank: every task would start a world of its own, each "
                         "with a rank 0\n" + fix)


def add_arguments(parser) -> None:  # for `harness --help`; cli.main hands `launch ...` to main() unparsed
    parser.add_argument("deepspeed_args", nargs="*", help="the `deepspeed` command's arguments")


def become_subreaper() -> bool:
    """Orphaned descendants reparent to this process instead of init, so it can wait for all of them."""
    if not sys.platform.startswith("linux"):
        return False
    with contextlib.suppress(OSError, AttributeError):
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    return False


def read_reports(exit_dir: Path) -> list[dict]:
    """The ranks' exit reports, in the order they were written."""
    reports = []
    for path in exit_dir.glob("rank*.json"):
        with contextlib.suppress(OSError, ValueError):
            reports.append((path.stat().st_mtime_ns, json.loads(path.read_text())))
    return [r for _, r in sorted(reports, key=lambda t: t[0])]


def ranks_code(exit_dir: Path, fallback: int) -> int:
    """The launch's exit code from the ranks' reports (see the module docstring)."""
    reports = read_reports(exit_dir)
    codes = [r["code"] for r in reports]
    failed = [c for c in codes if c not in (0, EXIT_PREEMPTED)]
    if failed:
        return failed[0]
    if EXIT_PREEMPTED in codes:
        return EXIT_PREEMPTED
    if codes and len(codes) == reports[0]["local_world_size"]:
        return 0
    return fallback


def rank_codes(exit_dir: Path) -> dict[str, int | None]:
    """{rank: exit code} of this node's ranks; None for a rank that left no report (killed)."""
    reports = read_reports(exit_dir)
    codes: dict[int, int | None] = {r["rank"]: r["code"] for r in reports}
    local = max((r["local_world_size"] for r in reports), default=0)
    if codes and max(codes) < local:  # the first node: its ranks are 0 .. local - 1
        codes.update({r: None for r in range(local) if r not in codes})
    return {str(r): codes[r] for r in sorted(codes)}


def describe(codes: dict[str, int | None], runner_code: int) -> str:
    """Why an attempt failed, in words: each rank's code, then the launcher's (a signal named when it is one)."""
    parts = [f"rank {r} {'left no exit report (killed)' if c is None else f'exited {c}'}"
             for r, c in codes.items() if c != 0]
    signum = runner_code - 128 if 128 < runner_code < 193 else 256 - runner_code if runner_code > 192 else None
    with contextlib.suppress(ValueError):
        if signum:  # DeepSpeed's launcher exits with a rank's negative code: -9 -> 247
            return ", ".join(parts + [f"launcher exit {runner_code} (a rank ended by {signal.Signals(signum).name})"])
    return ", ".join(parts + [f"launcher exit {runner_code}"])


def shell_code(code: int) -> int:
    return 128 - code if code < 0 else code  # killed by signal N: the shell's 128 + N


def signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def wait_all(child: subprocess.Popen, stop_if=None) -> int:
    """Wait for the runner, then for every other process that reparented here; the runner's exit code.
    stop_if(code), asked once the runner is gone: True ends what is left of its process group (SIGTERM, SIGKILL
    after STOP_GRACE_S) instead of letting it finish (which it must when the ranks save after a signal)."""
    code, kill_at = None, None
    while True:
        try:  # a forwarded signal interrupts it; PEP 475 retries after the handler
            pid, status = os.waitpid(-1, 0 if kill_at is None else os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:  # stopping: nothing exited yet
            if time.monotonic() >= kill_at:
                signal_group(child.pid, signal.SIGKILL)
                kill_at = None
            time.sleep(0.05)
        elif pid == child.pid:
            code = child.returncode = os.waitstatus_to_exitcode(status)
            if stop_if is not None and stop_if(shell_code(code)):
                signal_group(child.pid, signal.SIGTERM)  # the group outlives its leader while members remain
                kill_at = time.monotonic() + STOP_GRACE_S
    return shell_code(child.returncode if code is None else code)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    try:
        opts, rest = parse_own(argv)
        if opts.dry_run:
            from harness.commands import launch_check

            return launch_check.main(split_command(rest, "--dry-run", "it makes harness/run.py's checks"))
        check_slurm_step(rest)
        command = split_command(rest) if opts.max_restarts and rest else None
    except (UsageError, ConfigError) as e:
        print(f"error: {without_secrets(str(e))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except SystemExit as e:  # DeepSpeed's parser printed its usage
        return e.code if isinstance(e.code, int) else EXIT_BAD_INPUT
    if not rest:
        print(USAGE, file=sys.stderr)
        return EXIT_BAD_INPUT
    become_subreaper()
    exit_root = Path(tempfile.mkdtemp(prefix="dsharness-exit-"))
    started: list[subprocess.Popen] = []
    pending: list[int] = []

    def forward(signum, frame):
        pending.append(signum)
        for child in started:
            signal_group(child.pid, signum)

    # Handlers, not SIG_IGN, until the runner exists: an ignored signal would stay ignored across its exec.
    saved = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    try:
        return attempts(rest, command, opts, exit_root, started, pending)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        shutil.rmtree(exit_root, ignore_errors=True)


def run_attempt(argv: list[str], exit_dir: Path, started: list, pending: list[int], restart_next: bool) -> tuple:
    """One `deepspeed` run, waited for whole: (the launch's code, the runner's own code)."""
    env = {**os.environ, EXIT_DIR_ENV: str(exit_dir)}
    child = subprocess.Popen([sys.executable, "-m", deepspeed_runner.MODULE, *argv], env=env,
                             start_new_session=True)
    started[:] = [child]
    for signum in pending:  # arrived while it was starting
        signal_group(child.pid, signum)

    def failed(runner_code: int) -> bool:  # a restart follows: end every process of this attempt first
        return restart_next and not pending and ranks_code(exit_dir, runner_code) not in NOT_RESTARTED

    try:
        runner_code = wait_all(child, stop_if=failed)
    finally:
        started.clear()  # its process group is gone: never signal that number again
    return ranks_code(exit_dir, runner_code), runner_code


def backoff(seconds: float, pending: list[int]) -> bool:
    """Sleep before a restart; False when a signal came meanwhile (then nothing restarts)."""
    end = time.monotonic() + seconds
    while not pending and (left := end - time.monotonic()) > 0:
        time.sleep(min(left, 0.1))
    return not pending


def attempts(argv: list[str], command: Command | None, opts: Options, exit_root: Path, started: list,
             pending: list[int]) -> int:
    """Attempt after attempt until one ends in a code that is not restarted, a signal came, or N are used."""
    attempt, run_dir = 1, None
    while True:
        exit_dir = exit_root / str(attempt)
        exit_dir.mkdir()
        left = attempt <= opts.max_restarts
        code, runner_code = run_attempt(argv, exit_dir, started, pending, restart_next=left)
        if command is None or pending or code in NOT_RESTARTED:
            return code
        run_dir = run_dir or restarts.reported_run_dir(exit_dir)
        reason = describe(rank_codes(exit_dir), runner_code)
        if not left:
            say("restart", f"attempt {attempt} failed ({reason}); --max-restarts {opts.max_restarts} used up: "
                           f"exit {code}")
            return code
        wait_s = min(opts.backoff_s * 2 ** min(attempt - 1, 30), max(BACKOFF_CAP_S, opts.backoff_s))
        script_args, tag = restarts.restart_args(command.script_args, run_dir)
        record = {"attempt": attempt, "time": round(time.time(), 3), "code": code, "exit_codes": rank_codes(exit_dir),
                  "reason": reason, "backoff_s": wait_s, "resume_from": tag, "script_args": script_args}
        if run_dir is not None:
            restarts.append(run_dir, record)
        say("restart", f"attempt {attempt} failed ({reason}); restart {attempt}/{opts.max_restarts} in "
                       f"{wait_s:g} s, {f'from {tag}' if tag else 'from the start'}"
                       f"{f' in {run_dir}' if run_dir else ''}")
        if not backoff(wait_s, pending):
            return code
        argv = [*command.head, command.script, *script_args]
        attempt += 1


def run(args) -> int:
    return main(list(args.deepspeed_args))
