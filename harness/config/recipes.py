"""Recipes: small JSON deltas over the defaults in recipe.schema.json.

load_recipe() reads one (by name from recipes/ or by path), checks it strictly, fills defaults,
applies typed `--set key=value` overrides and returns the complete recipe dict.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

from harness.errors import ConfigError, Problem, UsageError
from harness.config.jsonio import load_json
from harness.config.schema import RECIPE_SCHEMA, defaults, load_schema, subschema, suggest, validate

ROOT_ENV = "DSHARNESS_ROOT"  # a folder holding recipes/ and ds_configs/ (a copy of the repo, in tests)


def project_root() -> Path:
    """Where recipes/ and ds_configs/ live: $DSHARNESS_ROOT if set, else this checkout (read at each call)."""
    return Path(os.environ.get(ROOT_ENV) or Path(__file__).resolve().parents[2])


def recipe_dir() -> Path:
    return project_root() / "recipes"


def recipe_names() -> list[str]:
    return sorted(p.stem for p in recipe_dir().glob("*.json"))


def recipe_path(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix == ".json" and path.is_file():
        return path
    candidate = recipe_dir() / f"{name_or_path}.json"
    if candidate.is_file():
        return candidate
    names = recipe_names()
    hint = suggest(name_or_path, names)
    raise UsageError(f"unknown recipe {name_or_path!r}{' (' + hint + ')' if hint else ''}\n"
                     f"    valid recipes: {', '.join(names)} (or a path to a recipe .json file)")


def deep_merge(base: dict, delta: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in delta.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _leaf_keys(schema: dict, prefix: str = "") -> list[str]:
    keys = []
    for key, prop in schema.get("properties", {}).items():
        dotted = f"{prefix}{key}"
        if prop.get("type") == "object" and "properties" in prop:
            keys += _leaf_keys(prop, dotted + ".")
        else:
            keys.append(dotted)
    return keys


def parse_override(item: str) -> tuple[str, object]:
    """'a.b=value' -> ('a.b', typed value). JSON literals are parsed; anything else is a string."""
    if "=" not in item:
        raise UsageError(f"--set {item!r}: expected KEY=VALUE, e.g. --set train.steps=20")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key.startswith("deepspeed.") and subschema(RECIPE_SCHEMA, key) is None:
        hint = suggest(key, _leaf_keys(load_schema(RECIPE_SCHEMA)))
        raise UsageError(f"--set {key}: not a recipe key{' (' + hint + ')' if hint else ''}\n"
                         f"    see `harness recipes --keys` for every key")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key, value


def apply_overrides(recipe: dict, overrides: list[str]) -> dict:
    out = copy.deepcopy(recipe)
    for item in overrides:
        key, value = parse_override(item)
        node = out
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):  # an earlier --set (or the recipe) made it a value
                raise UsageError(f"--set {key}: {'.'.join(parts[:i + 1])} is {json.dumps(node)}, not a block of keys")
        node[parts[-1]] = value
    return out


def complete(raw: dict, source: str, overrides: list[str] = ()) -> dict:
    """Defaults <- raw recipe <- overrides, validated against the recipe schema (all errors at once)."""
    problems = validate(raw, RECIPE_SCHEMA)
    if problems:
        raise ConfigError(problems, source)
    recipe = apply_overrides(deep_merge(defaults(load_schema(RECIPE_SCHEMA)), raw), list(overrides))
    problems = validate(recipe, RECIPE_SCHEMA)
    if problems:
        raise ConfigError([Problem(p.path, p.message + " (after --set overrides)", p.fix) for p in problems], source)
    return recipe


def load_recipe(name_or_path: str, overrides: list[str] = ()) -> tuple[dict, str]:
    """Return (complete recipe, source path)."""
    path = recipe_path(name_or_path)
    return complete(load_json(path), str(path), overrides), str(path)


def describe(name: str) -> str:
    return load_json(recipe_path(name)).get("description", "")
