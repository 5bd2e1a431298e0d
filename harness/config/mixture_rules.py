"""Rules for a mixture (train.datasets, harness/data/mixture.py) that need no data: every source has a name of its
own, and the objective reads every source's format. Pure: the recipe only (a source's files are checked in
harness/train/checks.py, before any rank trains)."""

from __future__ import annotations

import re
from pathlib import Path

from harness.config.resolve import Context
from harness.errors import Problem

PAIRS_FORMAT = "pairs"  # preference records (chosen / rejected): only a preference objective reads them
BUILTIN = "builtin"


def derived_name(dataset: str) -> str:
    """builtin -> builtin; a file or folder -> its stem; a hub id -> its last part; [A-Za-z0-9_.-] only."""
    if dataset == BUILTIN:
        return BUILTIN
    path = Path(dataset.rstrip("/"))
    stem = path.stem if path.suffix else path.name
    return re.sub(r"[^A-Za-z0-9_.-]", "_", stem) or "source"


def source_name(entry: dict) -> str:
    return entry.get("name") or derived_name(entry["dataset"])


def _format_problem(i: int, entry: dict, train: dict) -> Problem | None:
    objective, fmt = train.get("objective", "lm"), entry.get("format", train.get("format", "text"))
    name, path = source_name(entry), f"train.datasets[{i}].format"
    if objective != "lm":
        return Problem(path, f"train.objective {objective!r} reads preference pairs from one train.dataset; "
                       "mixtures (train.datasets) of preference sets are not supported",
                       "name one preference set in train.dataset and remove train.datasets")
    if fmt == PAIRS_FORMAT:
        return Problem(path, f"source {name!r} holds preference pairs (format {PAIRS_FORMAT!r}), which "
                       "train.objective 'lm' cannot read: a language-model run reads packed rows of text, "
                       "instruction or chat records",
                       "drop the source from the mixture, or train it alone with train.objective=dpo (or ipo, "
                       "simpo, orpo)")
    return None


def check_mixture(ds: dict, ctx: Context) -> list[Problem]:
    train = ctx.recipe.get("train", {})
    entries = [e for e in train.get("datasets") or [] if isinstance(e, dict) and isinstance(e.get("dataset"), str)]
    out, seen = [], {}
    for i, entry in enumerate(entries):
        name = source_name(entry)
        if name in seen:
            derived = "" if entry.get("name") else " (derived from its dataset)"
            out.append(Problem(f"train.datasets[{i}].name", f"two sources are named {name!r}: "
                               f"train.datasets[{seen[name]}] and train.datasets[{i}]{derived}",
                               f"give each source its own name: set train.datasets[{i}].name"))
        seen.setdefault(name, i)
        if problem := _format_problem(i, entry, train):
            out.append(problem)
    return out
