"""`harness`: one small CLI, one module per subcommand (harness/commands/NAME.py)."""

from __future__ import annotations

import argparse
import importlib
import sys

from harness.errors import ConfigError, RunComplete, UsageError, without_secrets
from harness.startup import quick_start

COMMANDS = {
    "recipes": "list the shipped recipes",
    "build": "generate ds_configs/ from recipes/ (--check: verify they are in sync)",
    "validate": "check recipes or DeepSpeed JSON files; exit 2 listing every problem",
    "show": "print the resolved DeepSpeed JSON for a recipe and world size",
    "plan": "memory, communication and step-time math; recommend the fastest layout that fits",
    "calibrate": "measure this machine (GEMMs, collectives, copies, CPU Adam, NVMe) into a hardware profile",
    "export": "write a Hugging Face model folder from a DeepSpeed checkpoint",
    "report": "predicted vs measured tables and plots for a run folder",
    "data": "tokenize a dataset once into the memory-mapped token store runs read (data prepare)",
    "launch": "`deepspeed ...` that forwards SIGTERM/SIGUSR1 to every rank, waits for all, returns their code",
    "slurm": "write (--submit: and submit) a Slurm batch script: one harness launch per node, checkpoint and "
             "requeue before the time limit",
    "k8s": "write Kubeflow Trainer manifests (TrainingRuntime + TrainJob): one harness launch per node, exit 75 "
           "restarts without spending retries, a grace period that covers a step and a save",
    "doctor": "check this machine before a long job (versions, GPUs, DeepSpeed ops, paths); exit 1 if --recipe cannot run",
}


def _module(name: str):
    return importlib.import_module(f"harness.commands.{name}")


def parser_for(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="harness", description="DeepSpeed training harness")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, text in COMMANDS.items():
        p = sub.add_parser(name, help=text, description=text)
        if name == chosen:  # import only the command in use: plan/export pull in heavy libraries
            _module(name).add_arguments(p)
    return parser


def innermost(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)parser of the command given (`harness data prepare`), whose usage an error should show."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and getattr(args, action.dest, None) in action.choices:
            return innermost(action.choices[getattr(args, action.dest)], args)
    return parser


def parse(argv: list[str]) -> argparse.Namespace:
    """argparse reports an unknown flag with the top parser's usage (`harness: error`); name the command typed."""
    parser = parser_for(argv)
    args, extra = parser.parse_known_args(argv)
    if extra:
        innermost(parser, args).error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    quick_start()  # before any command imports DeepSpeed (calibrate, doctor, export), as a rank does
    if argv[:1] == ["launch"]:  # the rest is DeepSpeed's command line, which argparse must not read
        return _module("launch").main(argv[1:])
    try:
        args = parse(argv)
        return _module(args.command).run(args)
    except (ConfigError, UsageError) as e:
        print(f"error: {without_secrets(str(e))}", file=sys.stderr)
        return 2
    except RunComplete as e:  # `harness slurm` for a finished run: nothing to submit, as a resumed run says
        print(f"[done] {e}")
        return 0
    except SystemExit as e:  # argparse: --help (0) or a usage error (2; it printed the message)
        return e.code if isinstance(e.code, int) else 0 if e.code is None else 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
