"""docs/recipes.md, generated: every shipped recipe with its description and the keys it sets, and every recipe key
with its type, default and description, read from recipes/*.json and recipe.schema.json.

`harness build` writes it beside ds_configs/ and `harness build --check` fails when it drifts, so the page can never
say something the schema does not. Pure text: no file is written here.
"""

from __future__ import annotations

import json

from harness.config.jsonio import load_json
from harness.config.recipes import recipe_names, recipe_path
from harness.config.schema import RECIPE_SCHEMA, load_schema

DOC_PATH = "docs/recipes.md"  # relative to the project root, like ds_configs/
_SKIP = ("$schema", "description")  # not keys a recipe tunes


def key_rows(schema: dict, prefix: str = "") -> list[tuple[str, dict]]:
    """(dotted key, its schema) for every leaf key, in schema order; a block with properties is walked, not listed."""
    rows = []
    for key, prop in schema.get("properties", {}).items():
        if key == "$schema":
            continue
        if "properties" in prop:
            rows += key_rows(prop, f"{prefix}{key}.")
        else:
            rows.append((f"{prefix}{key}", prop))
    return rows


def default_text(prop: dict) -> str:
    return json.dumps(prop["default"]) if "default" in prop else "(required)"


def type_text(prop: dict) -> str:
    """A key's accepted values in a few words: `bf16 | fp16 | fp32`, `integer 0-3`, `integer >= 1 or "auto"`."""
    if "enum" in prop:
        return " | ".join(json.dumps(v) if not isinstance(v, str) else v for v in prop["enum"])
    if "const" in prop:
        return json.dumps(prop["const"])
    if "anyOf" in prop:
        return " or ".join(type_text(p) for p in prop["anyOf"])
    kinds = prop.get("type", "any")
    text = " or ".join(kinds) if isinstance(kinds, list) else kinds
    if text == "array" and "items" in prop:
        text = f"array of {type_text(prop['items'])}"
    low, high = prop.get("minimum"), prop.get("maximum")
    if low is not None and high is not None:
        return f"{text} {low}-{high}"
    if low is not None:
        return f"{text} >= {low}"
    if "exclusiveMinimum" in prop:
        return f"{text} > {prop['exclusiveMinimum']}"
    return text


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _set_keys(recipe: dict, prefix: str = "") -> list[str]:
    """`zero.stage=3`-style lines for what a recipe file sets over the defaults."""
    out = []
    for key, value in recipe.items():
        if not prefix and key in _SKIP:
            continue
        if isinstance(value, dict) and value:
            out += _set_keys(value, f"{prefix}{key}.")
        else:
            out.append(f"`{prefix}{key}={json.dumps(value)}`")
    return out


def _recipe_section() -> list[str]:
    lines = ["## Recipes", "",
             "Each is a small delta over the defaults below (`recipes/NAME.json`); `harness build` turns it into",
             "`ds_configs/NAME.json`. Run one with `--recipe NAME`; override any key with `--set KEY=VALUE`.", ""]
    for name in recipe_names():
        raw = load_json(recipe_path(name))
        lines += [f"### {name}", "", raw.get("description", ""), "",
                  f"[recipes/{name}.json](../recipes/{name}.json) sets: {', '.join(_set_keys(raw)) or 'nothing'}", ""]
    return lines


def _table(rows: list[tuple[str, dict]]) -> list[str]:
    lines = ["| key | type | default | description |", "|---|---|---|---|"]
    for dotted, prop in rows:
        lines.append(f"| `{dotted}` | {_cell(type_text(prop))} | `{_cell(default_text(prop))}` "
                     f"| {_cell(prop.get('description', ''))} |")
    return lines


def _block(dotted: str, prop: dict, level: str) -> list[str]:
    """One block of keys: its heading and description, a table of its own keys, then its sub-blocks."""
    leaves = [(f"{dotted}.{k}", p) for k, p in prop["properties"].items() if "properties" not in p]
    lines = ["", f"{level} `{dotted}`", "", prop.get("description", ""), ""]
    lines += _table(leaves) if leaves else []
    for key, sub in prop["properties"].items():
        if "properties" in sub:
            lines += _block(f"{dotted}.{key}", sub, level + "#")
    return lines


def _key_section(schema: dict) -> list[str]:
    props = {k: p for k, p in schema["properties"].items() if k != "$schema"}
    lines = ["## Keys", "", "Every key a recipe or `--set` takes, with its accepted values and default "
             "(`harness recipes --keys` prints the same list).", "", "### top level", ""]
    lines += _table([(k, p) for k, p in props.items() if "properties" not in p])
    for key, prop in props.items():
        if "properties" in prop:
            lines += _block(key, prop, "###")
    return lines


def render() -> str:
    """The full text of docs/recipes.md."""
    schema = load_schema(RECIPE_SCHEMA)
    head = ["# Recipes and keys", "",
            "<!-- Generated by `harness build` from recipes/*.json and harness/schemas/recipe.schema.json: do not "
            "edit; `harness build --check` fails when this page drifts. -->", "",
            schema.get("description", ""), ""]
    return "\n".join(head + _recipe_section() + _key_section(schema)) + "\n"
