"""`harness recipes [--keys]`: the shipped recipes with their descriptions, or every recipe key."""

from __future__ import annotations

import argparse
import json

from harness.config.recipes import describe, recipe_names
from harness.config.schema import RECIPE_SCHEMA, load_schema


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--keys", action="store_true", help="list every recipe key with its default")


def _keys(schema: dict, prefix: str = "") -> list[tuple[str, str, str]]:
    rows = []
    for key, prop in schema.get("properties", {}).items():
        if key == "$schema":
            continue
        if "properties" in prop:
            rows += _keys(prop, f"{prefix}{key}.")
        else:
            default = json.dumps(prop["default"]) if "default" in prop else "(required)"
            rows.append((f"{prefix}{key}", default, prop.get("description", "")))
    return rows


def run(args: argparse.Namespace) -> int:
    if args.keys:
        rows = _keys(load_schema(RECIPE_SCHEMA))
        width = max(len(r[0]) for r in rows)
        for key, default, text in rows:
            print(f"{key:<{width}}  {default:<12}  {text}")
        return 0
    names = recipe_names()
    width = max(map(len, names))
    for name in names:
        print(f"{name:<{width}}  {describe(name)}")
    return 0
