"""Helpers shared by subcommands: read a recipe or DeepSpeed file, build the checking context."""

from __future__ import annotations

import argparse
from pathlib import Path

from harness.errors import UsageError
from harness.jsonio import load_json
from harness.model_shapes import load_model_config, shape_summary
from harness.recipes import complete, load_recipe
from harness.resolve import Context
from harness.validate import Checked, check_ds_config, check_recipe

DEFAULTS_SOURCE = "<recipe defaults>"


def world_size_arg(text: str) -> int:
    """argparse type of --world-size: a whole number of ranks, at least 1."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number of ranks >= 1")
    return int(text)


def model_shape(spec: str) -> dict | None:
    """Shape of a preset, known model or local dir; None for a hub id (not looked up offline)."""
    try:
        return shape_summary(load_model_config(spec))
    except UsageError:
        if Path(spec).exists():
            raise
        return None


def is_recipe(data: dict) -> bool:
    return "description" in data or str(data.get("$schema", "")).endswith("recipe.schema.json")


def context(recipe: dict, world_size: int | None, model: str | None = None,
            fp16_supported: bool | None = None) -> Context:
    name = model or recipe["train"]["model"]
    return Context(recipe=recipe, world_size=world_size, model=model_shape(name), model_name=name,
                   fp16_supported=fp16_supported)


def check_file(path: str, world_size: int | None, model: str | None = None, overrides=()) -> tuple[Checked, dict]:
    """Validate a recipe or a DeepSpeed JSON file. Returns (checked DeepSpeed dict, run recipe)."""
    data = load_json(path)
    if is_recipe(data):
        recipe = complete(data, path, overrides)
        return check_recipe(recipe, context(recipe, world_size, model), path), recipe
    recipe = complete({"description": DEFAULTS_SOURCE}, DEFAULTS_SOURCE, overrides)
    return check_ds_config(data, context(recipe, world_size, model), path), recipe


def check_named(name: str, world_size: int | None, model: str | None = None, overrides=()) -> tuple[Checked, dict]:
    recipe, source = load_recipe(name, overrides)
    return check_recipe(recipe, context(recipe, world_size, model), source), recipe
