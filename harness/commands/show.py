"""`harness show NAME --world-size N`: the DeepSpeed JSON a launch would use, and where filled values came from."""

from __future__ import annotations

import argparse
import sys

from harness.commands.common import check_file, check_named, world_size_arg
from harness.config.jsonio import dump_json
from harness.config.resolve import render_provenance


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help="recipe name, recipe file, or DeepSpeed config file")
    parser.add_argument("--world-size", type=world_size_arg, required=True, help="number of ranks")
    parser.add_argument("--model", help="model (default: a recipe's train.model; a bare DeepSpeed file has none)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="recipe override, e.g. --set batch.micro_batch_per_gpu=2")


def run(args: argparse.Namespace) -> int:
    if args.name.endswith(".json"):
        checked, _ = check_file(args.name, args.world_size, args.model, args.overrides)
    else:
        checked, _ = check_named(args.name, args.world_size, args.model, args.overrides)
    sys.stdout.write(dump_json(checked.ds_config))
    print(render_provenance(checked.provenance), file=sys.stderr)
    for w in checked.warnings:
        print("warning: " + w.render(args.name), file=sys.stderr)
    for n in checked.notes:
        print("note: " + n.render(args.name), file=sys.stderr)
    return 0
