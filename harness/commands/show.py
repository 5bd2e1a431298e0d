"""`harness show NAME --world-size N`: the DeepSpeed JSON a launch would use, and where filled values came from."""

from __future__ import annotations

import argparse
import json
import sys

from harness.commands.common import check_file, check_named, world_size_arg
from harness.jsonio import dump_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help="recipe name, recipe file, or DeepSpeed config file")
    parser.add_argument("--world-size", type=world_size_arg, required=True, help="number of ranks")
    parser.add_argument("--model", help="model (default: the recipe's train.model)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="recipe override, e.g. --set batch.micro_batch_per_gpu=2")


def render_provenance(provenance: dict[str, dict]) -> str:
    if not provenance:
        return "filled values: none (no \"auto\" in this config)"
    width = max(len(p) for p in provenance)
    lines = ["filled values:"]
    for path, item in provenance.items():
        lines.append(f"  {path:<{width}} = {json.dumps(item['value']):<12} <- {item['source']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.name.endswith(".json"):
        checked, _ = check_file(args.name, args.world_size, args.model, args.overrides)
    else:
        checked, _ = check_named(args.name, args.world_size, args.model, args.overrides)
    sys.stdout.write(dump_json(checked.ds_config))
    print(render_provenance(checked.provenance), file=sys.stderr)
    for w in checked.warnings:
        print("warning: " + w.render(args.name), file=sys.stderr)
    return 0
