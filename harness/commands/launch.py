"""`harness launch [deepspeed options] harness/run.py ...`: DeepSpeed's own `deepspeed` command, made safe to signal.

The `deepspeed` command (launcher/runner.py) has no signal handler on one node: SIGTERM ends it at once while
its per-node launcher and the ranks go on to save, so whatever waits on it (a container runtime, a job step, a
CI runner) tears the ranks down mid-save; as a container's PID 1 it ignores SIGTERM altogether. This wrapper:
  - starts the runner (same arguments, same environment) in a process group of its own;
  - forwards SIGTERM, SIGUSR1 and SIGINT to that whole group, so every rank gets the signal at once (they
    agree on a step, save and exit 75: harness/train/preempt.py);
  - waits until every process of the tree is gone: it is a child subreaper (Linux), so the launcher and
    ranks that outlive the runner become its children, and as a container's PID 1 it reaps what reparents to it;
  - exits with the ranks' code: each rank writes its exit code into a folder named by DSHARNESS_EXIT_DIR
    (the launcher exits 1 after a signal whatever its ranks return). A failing rank's code wins (the first
    to fail), then 75 if any rank was preempted, then 0 when every local rank reported 0; with no report
    (ranks on other nodes started over ssh, or killed before writing one) the runner's own code.
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
from pathlib import Path

from harness.train.preempt import EXIT_DIR_ENV, EXIT_PREEMPTED

FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>
USAGE = ("usage: harness launch [deepspeed options] SCRIPT [script args]\n"
         "  e.g. harness launch --num_gpus 8 harness/run.py --recipe zero3\n"
         "The arguments are DeepSpeed's `deepspeed` command's (deepspeed --help); SIGTERM/SIGUSR1/SIGINT to this\n"
         "process reach every rank, it returns once every process is gone, with the ranks' exit code\n"
         "(75: preempted with a checkpoint, --resume latest continues).")


def add_arguments(parser) -> None:  # for `harness --help`; cli.main hands `launch ...` to main() unparsed
    parser.add_argument("deepspeed_args", nargs="*", help="the `deepspeed` command's arguments")


def become_subreaper() -> bool:
    """Orphaned descendants reparent to this process instead of init, so it can wait for all of them."""
    if not sys.platform.startswith("linux"):
        return False
    with contextlib.suppress(OSError, AttributeError):
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    return False


def ranks_code(exit_dir: Path, fallback: int) -> int:
    """The launch's exit code from the ranks' reports (see the module docstring)."""
    reports = []
    for path in exit_dir.glob("rank*.json"):
        with contextlib.suppress(OSError, ValueError):
            reports.append((path.stat().st_mtime_ns, json.loads(path.read_text())))
    codes = [r["code"] for _, r in sorted(reports, key=lambda t: t[0])]
    failed = [c for c in codes if c not in (0, EXIT_PREEMPTED)]
    if failed:
        return failed[0]
    if EXIT_PREEMPTED in codes:
        return EXIT_PREEMPTED
    if codes and len(codes) == reports[0][1]["local_world_size"]:
        return 0
    return fallback


def wait_all(child: subprocess.Popen) -> int:
    """Wait for the runner, then for every other process that reparented here; the runner's exit code."""
    code = None
    while True:
        try:
            pid, status = os.waitpid(-1, 0)  # a forwarded signal interrupts it; PEP 475 retries after the handler
        except ChildProcessError:
            break
        if pid == child.pid:
            code = os.waitstatus_to_exitcode(status)
            child.returncode = code
    code = child.returncode if code is None else code
    return 128 - code if code < 0 else code  # killed by signal N: the shell's 128 + N


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    become_subreaper()
    exit_dir = Path(tempfile.mkdtemp(prefix="dsharness-exit-"))
    env = {**os.environ, EXIT_DIR_ENV: str(exit_dir)}
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", *argv]
    started: list[subprocess.Popen] = []
    pending: list[int] = []

    def forward(signum, frame):
        pending.append(signum)
        for child in started:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signum)

    # Handlers, not SIG_IGN, until the runner exists: an ignored signal would stay ignored across its exec.
    saved = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    try:
        started.append(subprocess.Popen(cmd, env=env, start_new_session=True))
        for signum in pending:  # arrived while it was starting
            with contextlib.suppress(ProcessLookupError):
                os.killpg(started[0].pid, signum)
        return ranks_code(exit_dir, wait_all(started[0]))
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        shutil.rmtree(exit_dir, ignore_errors=True)


def run(args) -> int:
    return main(list(args.deepspeed_args))
