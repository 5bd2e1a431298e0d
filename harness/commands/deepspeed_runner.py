"""DeepSpeed's `deepspeed` command and its per-node launcher, each started the way a rank starts (harness.ops,
the CPU accelerator pinned where it is the only one, harness.startup.quick_start before DeepSpeed is imported).

    python -m harness.commands.deepspeed_runner [deepspeed options] SCRIPT ...      the `deepspeed` command
    python -u -m harness.commands.deepspeed_runner deepspeed.launcher.launch ...   its per-node launcher

`harness launch` starts its runner this way, and the runner here starts its node's launcher this way. Per
launch, before any rank exists and after the last one ends (a nop 2-rank launch: 6.6 -> 2.8 s of CPU on the
2-core test machine):
  - neither process imports mlflow for DeepSpeed's autotuner (~1.4 s of CPU each; tests/test_quick_start.py);
  - neither finalizes the interpreter at exit (torch's and DeepSpeed's module teardown, 0.5-2 s each, while
    the process that waits on it waits);
  - the launcher looks at its ranks every 0.1 s, not every 1 s (_Time).
Everything else is DeepSpeed's own code (launcher/runner.py, launcher/launch.py): same arguments, same
environment, same processes, same exit codes. The launcher's command line still names deepspeed.launcher.launch,
as it does when DeepSpeed starts it.
"""

from __future__ import annotations

import subprocess
import sys
import time

LAUNCHER = "deepspeed.launcher.launch"
MODULE = "harness.commands.deepspeed_runner"
PROG = "harness launch"  # what DeepSpeed's usage and errors name: the command the user typed, not this file
POLL_S = 0.1


def through_here(cmd):
    """The runner's command for its node's launcher (`python -u -m deepspeed.launcher.launch ...`, the one-node
    and --no_ssh case) run through this module; any other command (pdsh, mpirun, srun to other nodes) as given."""
    if isinstance(cmd, list) and cmd[1:4] == ["-u", "-m", LAUNCHER]:
        return [cmd[0], "-u", "-m", MODULE, *cmd[3:]]
    return cmd


class _Subprocess:
    """What DeepSpeed's runner module sees as `subprocess`: the module itself, except that Popen starts the
    node's launcher through here (through_here)."""

    def __getattr__(self, name):
        return getattr(subprocess, name)

    @staticmethod
    def Popen(cmd, *args, **kwargs):  # noqa: N802 (subprocess's name)
        return subprocess.Popen(through_here(cmd), *args, **kwargs)


class _Time:
    """What DeepSpeed's launcher module sees as `time`: the module itself, except that sleep lasts at most
    POLL_S. Its only sleep is its wait for the ranks (a poll every 1 s): a launch then ends ~0.1 s after its
    last rank instead of up to 1 s after."""

    def __getattr__(self, name):
        return getattr(time, name)

    @staticmethod
    def sleep(seconds: float) -> None:
        time.sleep(min(seconds, POLL_S))


def main(argv: list[str]) -> None:
    """Run DeepSpeed's runner (or, named first, its launcher) with `argv`; returns as it does or raises its
    SystemExit."""
    from harness.ops import pin_cpu_accelerator
    from harness.startup import quick_start

    pin_cpu_accelerator()  # as `harness launch` does; the launcher and the ranks inherit it
    if not any(a.partition("=")[0] == "--autotuning" for a in argv):  # DeepSpeed's autotuner logs to mlflow
        quick_start()
    if argv[:1] == [LAUNCHER]:
        sys.argv[:] = argv  # its usage names deepspeed.launcher.launch, as when DeepSpeed starts it
        from deepspeed.launcher import launch

        launch.time = _Time()
        launch.main()
        return
    sys.argv[:] = [PROG, *argv]  # argparse names its prog after argv[0]: `harness launch: error: ...`
    from deepspeed.launcher import runner

    runner.subprocess = _Subprocess()
    runner.main()


def exit_code(e: SystemExit) -> int:
    if e.code is None or isinstance(e.code, int):
        return e.code or 0
    print(e.code, file=sys.stderr)  # as Python prints a SystemExit's message
    return 1


if __name__ == "__main__":
    from harness.dist import exit_now

    try:
        main(sys.argv[1:])
        code = 0
    except SystemExit as e:
        code = exit_code(e)
    # Both processes only wait on their children by now: no interpreter finalization (torch's and DeepSpeed's
    # module teardown, ~0.5-2 s per process, each in the launch's critical path)
    exit_now(code)
