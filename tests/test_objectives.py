"""The objectives registry (harness/config/objectives.py): every objective the schema offers is declared there once,
and every declared step class imports from the train/ or rl/ room."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

from harness.config.objectives import OBJECTIVES, objective_of

SCHEMA = Path(__file__).resolve().parents[1] / "harness" / "schemas" / "recipe.schema.json"


def test_the_schema_offers_exactly_the_declared_objectives():
    enum = json.loads(SCHEMA.read_text())["properties"]["train"]["properties"]["objective"]["enum"]
    assert sorted(enum) == sorted(OBJECTIVES)


def test_every_step_class_imports_from_its_room_and_every_block_exists():
    blocks = json.loads(SCHEMA.read_text())["properties"]
    for objective in OBJECTIVES.values():
        assert objective.block is None or objective.block in blocks, objective
        assert objective.family in ("lm", "preference", "rl", "distill")
        assert objective.data in ("corpus", "pairs", "prompts", "completions")
        if objective.steps is None:
            continue
        module, name = objective.steps.split(":")
        assert module.split(".")[1] in ("train", "rl"), objective.steps
        assert callable(getattr(importlib.import_module(module), name)), objective.steps


def test_a_recipe_names_its_objective():
    assert objective_of({"train": {"objective": "grpo"}}).rows == 1
    assert objective_of({"train": {"objective": "dpo"}}).rows == 2 and objective_of({}).name == "lm"
