"""JSON Schema validation that reports like a person would: JSON path, the value, and the fix.

Schemas are data shipped in harness/schemas/. Unknown keys get a "did you mean" from the keys the
schema allows at that level.
"""

from __future__ import annotations

import difflib
import json
from functools import cache
from pathlib import Path

import jsonschema

from harness.errors import Problem
from harness.config.jsonio import join_path

SCHEMA_DIR = Path(__file__).resolve().parent.parent / "schemas"
RECIPE_SCHEMA = "recipe.schema.json"
DS_SCHEMA = "ds_config.schema.json"
# An unknown key this similar to a known one (difflib ratio) is taken for a misspelling of it:
# gradient_clippping/gradient_clipping 0.97, train_micro_batch_size_per_gpus 0.98; comms_config/comms_logger 0.67.
TYPO_CUTOFF = 0.85


@cache
def load_schema(name: str) -> dict:
    return json.loads((SCHEMA_DIR / name).read_text())


@cache
def _validator(name: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(load_schema(name))


def suggest(word: str, choices, cutoff: float = 0.6) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=cutoff)
    return f"did you mean {close[0]!r}?" if close else ""


def _path(error: jsonschema.ValidationError, prefix: str) -> str:
    path = prefix
    for key in error.absolute_path:
        path = join_path(path, key)
    return path


def _expected(schema: dict) -> str:
    if "const" in schema:
        return json.dumps(schema["const"])
    if "enum" in schema:
        return "one of " + ", ".join(json.dumps(v) for v in schema["enum"])
    kind = schema.get("type", "value")
    text = " or ".join(kind) if isinstance(kind, list) else kind
    if "minimum" in schema:
        text += f" >= {schema['minimum']}"
    if "exclusiveMinimum" in schema:
        text += f" > {schema['exclusiveMinimum']}"
    if "maximum" in schema:
        text += f" <= {schema['maximum']}"
    return text


def _fix_hint(schema: dict) -> str:
    return schema.get("description", "")


def _unknown_key(path: str, key: str, allowed: set[str], kind: str | None, out_of_scope: dict) -> Problem:
    """DeepSpeed refuses unknown keys in its pydantic blocks (an error here too). Elsewhere ("dict" blocks) it
    ignores them: a near-miss of a key it reads is still an error (the setting would be lost without a word),
    any other key is a warning. Recipes (no x-deepspeed) are strict."""
    listing = f"allowed keys here: {', '.join(sorted(allowed))}"
    if kind != "dict":
        return Problem(path, f"unknown key {key!r}", suggest(key, allowed) or listing)
    if key in out_of_scope:
        return Problem(path, f"{key!r} is read by DeepSpeed but not checked by the harness", out_of_scope[key],
                       severity="warning")
    typo = suggest(key, allowed, TYPO_CUTOFF)
    if typo:
        return Problem(path, f"unknown key {key!r}: DeepSpeed silently ignores it, so this setting would be lost",
                       typo)
    return Problem(path, f"unknown key {key!r}: DeepSpeed ignores it", suggest(key, allowed) or listing,
                   severity="warning")


def _problems_for(error: jsonschema.ValidationError, prefix: str, out_of_scope: dict) -> list[Problem]:
    path = _path(error, prefix)
    schema = error.schema if isinstance(error.schema, dict) else {}
    if error.validator == "additionalProperties":
        allowed = set(schema.get("properties", {}))
        kind = schema.get("x-deepspeed")
        return [_unknown_key(join_path(path, k), k, allowed, kind, out_of_scope)
                for k in error.instance if k not in allowed and not (kind == "dict" and k.startswith("_"))]
    value = json.dumps(error.instance)
    if error.validator in ("anyOf", "oneOf"):
        problem = Problem(path, f"got {value}, expected {' or '.join(_expected(s) for s in error.validator_value)}",
                          _fix_hint(schema))
    elif error.validator == "enum":
        word = error.instance if isinstance(error.instance, str) else ""
        hint = suggest(word, [v for v in error.validator_value if isinstance(v, str)])
        problem = Problem(path, f"got {value}, expected {_expected(schema)}", hint or _fix_hint(schema))
    elif error.validator == "required":
        return [Problem(path, error.message, "add the missing key")]
    elif error.validator in ("type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "const"):
        problem = Problem(path, f"got {value}, expected {_expected(schema)}", _fix_hint(schema))
    else:
        return [Problem(path, error.message, _fix_hint(schema))]
    if error.instance == "auto":  # DeepSpeed drops it to the default ("stage": "auto" is stage 0) or crashes late
        problem = Problem(path, f'"auto" is not accepted here ({problem.message})', problem.fix)
    return [problem]


def validate(instance: dict, schema_name: str, prefix: str = "") -> list[Problem]:
    """Every schema violation as a Problem (empty list when valid)."""
    problems: list[Problem] = []
    errors = sorted(_validator(schema_name).iter_errors(instance), key=lambda e: list(map(str, e.absolute_path)))
    out_of_scope = load_schema(schema_name).get("x-out-of-scope-keys", {})
    for error in errors:
        problems.extend(_problems_for(error, prefix, out_of_scope))
    return problems


def subschema(schema_name: str, dotted: str) -> dict | None:
    """The schema of the property at a dotted path (objects only), or None if the path is unknown."""
    node = load_schema(schema_name)
    for key in dotted.split("."):
        props = node.get("properties", {})
        if key not in props:
            return None
        node = props[key]
    return node


def defaults(schema: dict) -> dict:
    """The default value of an object schema: each property's default, filled recursively."""
    out = {}
    for key, prop in schema.get("properties", {}).items():
        if prop.get("type") == "object" and "properties" in prop:
            out[key] = defaults(prop)
        elif "default" in prop:
            out[key] = json.loads(json.dumps(prop["default"]))
    return out
