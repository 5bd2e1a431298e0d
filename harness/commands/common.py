"""Helpers shared by subcommands: read a recipe or DeepSpeed file, build the checking context."""

from __future__ import annotations

import argparse

from harness.config.jsonio import load_json
from harness.config.recipes import complete, load_recipe
from harness.config.validate import Checked, check_ds_config, check_recipe, context, model_shape  # noqa: F401

DEFAULTS_SOURCE = "<recipe defaults>"


def world_size_arg(text: str) -> int:
    """argparse type of --world-size: a whole number of ranks, at least 1."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number of ranks >= 1")
    return int(text)


def is_recipe(data: dict) -> bool:
    return "description" in data or str(data.get("$schema", "")).endswith("recipe.schema.json")


def check_file(path: str, world_size: int | None, model: str | None = None, overrides=()) -> tuple[Checked, dict]:
    """Validate a recipe or a DeepSpeed JSON file. Returns (checked DeepSpeed dict, run recipe)."""
    data = load_json(path)
    if is_recipe(data):
        recipe = complete(data, path, overrides)
        return check_recipe(recipe, context(recipe, world_size, model), path), recipe
    recipe = complete({"description": DEFAULTS_SOURCE}, DEFAULTS_SOURCE, overrides)
    # a bare DeepSpeed file names no model: without --model, model checks are skipped (not run on a default)
    return check_ds_config(data, context(recipe, world_size, model, recipe_model=False), path), recipe


def check_named(name: str, world_size: int | None, model: str | None = None, overrides=()) -> tuple[Checked, dict]:
    recipe, source = load_recipe(name, overrides)
    return check_recipe(recipe, context(recipe, world_size, model), source), recipe
