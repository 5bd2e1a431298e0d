"""`harness recipes [--keys]`: the shipped recipes with their descriptions, or every recipe key."""

from __future__ import annotations

import argparse

from harness.config.recipes import describe, recipe_names
from harness.config.recipes_doc import default_text, key_rows
from harness.config.schema import RECIPE_SCHEMA, load_schema


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--keys", action="store_true", help="list every recipe key with its default")


def run(args: argparse.Namespace) -> int:
    if args.keys:
        rows = [(key, default_text(prop), prop.get("description", ""))
                for key, prop in key_rows(load_schema(RECIPE_SCHEMA))]
        width = max(len(r[0]) for r in rows)
        for key, default, text in rows:
            print(f"{key:<{width}}  {default:<12}  {text}")
        return 0
    names = recipe_names()
    width = max(map(len, names))
    for name in names:
        print(f"{name:<{width}}  {describe(name)}")
    return 0
