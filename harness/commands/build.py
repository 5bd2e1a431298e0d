"""`harness build [--check]`: regenerate ds_configs/ and docs/recipes.md from recipes/ and the recipe schema (or
check they are in sync)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from harness.config import builder, recipes_doc
from harness.commands.common import context
from harness.errors import UsageError
from harness.config.jsonio import dump_json
from harness.config.recipes import ROOT_ENV, load_recipe, project_root, recipe_dir, recipe_names
from harness.config.validate import check_recipe


def ds_config_dir() -> Path:
    return project_root() / "ds_configs"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if any ds_configs/ file or docs/recipes.md differs (writes nothing)")


def expected_files() -> dict[Path, str]:
    """ds_configs/NAME.json -> the text the builder produces for recipes/NAME.json (validated)."""
    out, ds_dir, names = {}, ds_config_dir(), recipe_names()
    if not names:  # a wrong $DSHARNESS_ROOT must not pass --check with "0 files in sync"
        raise UsageError(f"no recipes in {recipe_dir()} (check ${ROOT_ENV})")
    for name in names:
        recipe, source = load_recipe(name)
        check_recipe(recipe, context(recipe, None), source)  # world-independent checks; raises on errors
        out[ds_dir / f"{name}.json"] = dump_json(builder.build(recipe))
    return out


def run(args: argparse.Namespace) -> int:
    expected, ds_dir = expected_files(), ds_config_dir()
    stale = sorted(set(ds_dir.glob("*.json")) - set(expected))
    generated = {**expected, project_root() / recipes_doc.DOC_PATH: recipes_doc.render()}  # every file build owns
    changed = sorted(p for p, text in generated.items() if not p.is_file() or p.read_text() != text)
    if args.check:
        for path in changed:
            print(f"out of date: {path.relative_to(ds_dir.parent)}", file=sys.stderr)
        for path in stale:
            print(f"no recipe for: {path.relative_to(ds_dir.parent)}", file=sys.stderr)
        if changed or stale:
            print("run `harness build` to regenerate ds_configs/ and docs/recipes.md from recipes/", file=sys.stderr)
            return 1
        print(f"ds_configs/ in sync with recipes/ ({len(expected)} files)")
        return 0
    for path in changed:
        path.parent.mkdir(exist_ok=True)
        path.write_text(generated[path])
        print(f"wrote {path.relative_to(ds_dir.parent)}")
    for path in stale:
        path.unlink()
        print(f"removed {path.relative_to(ds_dir.parent)} (no recipe)")
    print(f"{len(expected)} configs, {len(changed)} written")
    return 0
