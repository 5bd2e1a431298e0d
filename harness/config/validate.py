"""One validation layer: removed/deprecated keys, schema, "auto" resolution, cross-field rules.

Everything is collected and reported at once. `check_recipe` and `check_ds_config` are what the
CLI and the runner call; both are pure (no process group).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path

from harness.config import builder
from harness.config.defaults import PATH_PREFIXES
from harness.errors import ConfigError, Problem, UsageError
from harness.config.jsonio import has_path, join_path, pop_path, setdefault_path
from harness.model_shapes import load_model_config, shape_summary
from harness.config.resolve import Context, degrees, resolve
from harness.config.rules import check
from harness.config.schema import DS_SCHEMA, load_schema, validate


# "auto" that DeepSpeed drops to a default so harmful that the harness refuses it (stricter than DeepSpeed):
# "stage": "auto" runs ZeRO stage 0, i.e. no ZeRO at all (accelerate fills it only from its own plugin config).
AUTO_REFUSED = ("zero_optimization.stage",)


@dataclass
class Checked:
    ds_config: dict  # resolved as far as the context allows
    provenance: dict[str, dict] = field(default_factory=dict)
    warnings: list[Problem] = field(default_factory=list)
    notes: list[Problem] = field(default_factory=list)  # what was not checked, and why


def model_shape(spec: str) -> dict | None:
    """Shape of a preset, known model or local dir; None for a hub id (not looked up offline)."""
    try:
        return shape_summary(load_model_config(spec))
    except UsageError:
        if Path(spec).exists() or spec.startswith(PATH_PREFIXES):  # a path that is not a model folder
            raise
        return None


def context(recipe: dict, world_size: int | None, model: str | None = None,
            fp16_supported: bool | None = None, model_config: dict | None = None,
            recipe_model: bool = True) -> Context:
    """What a config is checked against: run settings, world size, and the model's shape when known
    (`model_config`: its HF config dict, when the caller has loaded it, e.g. a hub model's at launch).
    `recipe_model=False` (a bare DeepSpeed file): no model unless one is named, so model checks are skipped."""
    if model is None and model_config is None and not recipe_model:
        return Context(recipe=recipe, world_size=world_size, fp16_supported=fp16_supported)
    name = model or recipe["train"]["model"]
    shape = shape_summary(model_config) if model_config is not None else model_shape(name)
    return Context(recipe=recipe, world_size=world_size, model=shape, model_name=name, fp16_supported=fp16_supported)


def normalize(ds: dict) -> tuple[dict, list[Problem]]:
    """Report removed keys (errors), remap deprecated ones and drop "auto" where DeepSpeed drops it (warnings),
    as DeepSpeed 0.19.8 would."""
    schema = load_schema(DS_SCHEMA)
    ds = copy.deepcopy(ds)
    problems = []
    for path, why in schema.get("x-removed-keys", {}).items():
        found, _ = pop_path(ds, path)
        if found:
            problems.append(Problem(path, f"{path.split('.')[-1]!r} was removed from DeepSpeed (0.19 raises "
                                    "DeepSpeedConfigError)", why))
    for old, new in schema.get("x-deprecated-keys", {}).items():
        found, value = pop_path(ds, old)
        if found:
            problems.append(Problem(old, f"deprecated key, remapped to {new}", f"write {new} instead",
                                    severity="warning"))
            if isinstance(value, bool) and new.endswith(("offload_optimizer", "offload_param")):
                value = {"device": "cpu"} if value else None
            if value is not None:
                setdefault_path(ds, new, value)
    problems += _drop_pydantic_autos(ds, schema, "")
    return ds, problems


def _drop_pydantic_autos(node: dict, schema: dict, path: str) -> list[Problem]:
    """DeepSpeed's pydantic blocks (DeepSpeedConfigModel, strict=False) drop an "auto" that nobody fills and use
    their default. Drop it here too and say what it becomes (AUTO_REFUSED stays, for the schema to refuse)."""
    out = []
    for key, value in list(node.items()):
        sub = schema.get("properties", {}).get(key)
        if sub is None:
            continue
        where = join_path(path, key)
        if isinstance(value, dict):
            out += _drop_pydantic_autos(value, sub, where)
        elif value == "auto" and schema.get("x-deepspeed") == "pydantic" and not sub.get("x-auto") \
                and where not in AUTO_REFUSED:
            del node[key]
            default = json.dumps(sub["default"]) if "default" in sub else "its default"
            out.append(Problem(where, f'"auto" here is filled by neither the HF Trainer nor accelerate: DeepSpeed '
                               f"drops it and uses {default}", "write the value you want", severity="warning"))
    return out


def with_recipe_paths(problems: list[Problem], raw_deepspeed: dict) -> list[Problem]:
    """Name the recipe key the user wrote: deepspeed.<path> for raw keys, else the builder's source key."""
    out = []
    for p in problems:
        if p.path and has_path(raw_deepspeed, p.path):
            out.append(Problem(f"deepspeed.{p.path}", p.message, p.fix, p.severity))
            continue
        source = builder.RECIPE_SOURCE.get(p.path)
        out.append(Problem(f"{source} (-> {p.path})", p.message, p.fix, p.severity) if source else p)
    return out


def check_ds_config(ds: dict, ctx: Context, source: str = "") -> Checked:
    """Validate (and resolve what ctx allows) a DeepSpeed dict. Raises ConfigError listing everything."""
    ds, problems = normalize(ds)
    resolved, provenance, unresolved = resolve(ds, ctx)
    problems += unresolved
    problems += validate(resolved, DS_SCHEMA)
    problems += check(resolved, ctx)
    problems += _unchecked_model(resolved, ctx)
    errors = [p for p in problems if p.severity == "error"]
    if errors:
        raise ConfigError(problems, source)
    return Checked(resolved, provenance, [p for p in problems if p.severity == "warning"],
                   [p for p in problems if p.severity == "note"])


def _unchecked_model(ds: dict, ctx: Context) -> list[Problem]:
    """Without a model (a bare DeepSpeed file and no --model), say which model checks were skipped."""
    pp, tp = degrees(ds, ctx.recipe)
    if ctx.model is not None or (pp == 1 and tp == 1):
        return []
    return [Problem("", f"model unknown (no --model, or a hub id not looked up offline): pipeline {pp} x tensor {tp} "
                    "was not checked against the model's layers and heads", "pass --model to check it",
                    severity="note")]


def check_recipe(recipe: dict, ctx: Context, source: str = "") -> Checked:
    """A complete recipe -> its DeepSpeed dict, validated; problems name the recipe key where possible."""
    raw = recipe.get("deepspeed", {})
    try:
        checked = check_ds_config(builder.build(recipe), ctx, source)
    except ConfigError as e:
        raise ConfigError(with_recipe_paths(e.problems, raw), source) from None
    checked.warnings = with_recipe_paths(checked.warnings, raw)
    return checked


def strip_annotations(ds: dict) -> dict:
    """The dict DeepSpeed gets: without our "$schema" reference."""
    return {k: v for k, v in ds.items() if k != "$schema"}


__all__ = ["Checked", "Context", "check_ds_config", "check_recipe", "normalize", "strip_annotations", "join_path",
           "with_recipe_paths"]
