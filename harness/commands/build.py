"""`harness build [--check]`: regenerate ds_configs/ from recipes/ (or check they are in sync)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from harness import builder
from harness.commands.common import context
from harness.jsonio import dump_json
from harness.recipes import RECIPE_DIR, load_recipe, recipe_names
from harness.validate import check_recipe

DS_CONFIG_DIR = RECIPE_DIR.parent / "ds_configs"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--check", action="store_true", help="exit 1 if any ds_configs/ file differs (writes nothing)")


def expected_files() -> dict[Path, str]:
    """ds_configs/NAME.json -> the text the builder produces for recipes/NAME.json (validated)."""
    out = {}
    for name in recipe_names():
        recipe, source = load_recipe(name)
        check_recipe(recipe, context(recipe, None), source)  # world-independent checks; raises on errors
        out[DS_CONFIG_DIR / f"{name}.json"] = dump_json(builder.build(recipe))
    return out


def run(args: argparse.Namespace) -> int:
    expected = expected_files()
    existing = set(DS_CONFIG_DIR.glob("*.json"))
    stale = sorted(existing - set(expected))
    changed = sorted(p for p, text in expected.items() if not p.is_file() or p.read_text() != text)
    if args.check:
        for path in changed:
            print(f"out of date: {path.relative_to(DS_CONFIG_DIR.parent)}", file=sys.stderr)
        for path in stale:
            print(f"no recipe for: {path.relative_to(DS_CONFIG_DIR.parent)}", file=sys.stderr)
        if changed or stale:
            print("run `harness build` to regenerate ds_configs/ from recipes/", file=sys.stderr)
            return 1
        print(f"ds_configs/ in sync with recipes/ ({len(expected)} files)")
        return 0
    DS_CONFIG_DIR.mkdir(exist_ok=True)
    for path in changed:
        path.write_text(expected[path])
        print(f"wrote {path.relative_to(DS_CONFIG_DIR.parent)}")
    for path in stale:
        path.unlink()
        print(f"removed {path.relative_to(DS_CONFIG_DIR.parent)} (no recipe)")
    print(f"{len(expected)} configs, {len(changed)} written")
    return 0
