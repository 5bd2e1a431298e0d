"""`harness validate FILE... [--world-size N] [--model M]`: recipes or DeepSpeed JSON; exit 2 if any is invalid."""

from __future__ import annotations

import argparse
import sys

from harness.commands.common import check_file, world_size_arg
from harness.errors import ConfigError, UsageError, without_secrets


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", metavar="FILE", help="recipe or DeepSpeed config JSON")
    parser.add_argument("--world-size", type=world_size_arg,
                        help="check batch arithmetic and degrees for this many ranks")
    parser.add_argument("--model", help="model preset, known name or local dir (for tp/heads and bucket autos)")


def run(args: argparse.Namespace) -> int:
    status = 0
    for path in args.files:
        try:
            checked, _ = check_file(path, args.world_size, args.model)
        except (ConfigError, UsageError) as e:
            print(without_secrets(str(e)), file=sys.stderr)
            status = 2
            continue
        for w in checked.warnings:
            print("warning: " + w.render(path), file=sys.stderr)
        for n in checked.notes:
            print("note: " + n.render(path), file=sys.stderr)
        where = f" for world size {args.world_size}" if args.world_size else ""
        print(f"{path}: valid{where}")
    return status
