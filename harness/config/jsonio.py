"""Read JSON the strict way: duplicate keys and NaN/Infinity are reported with their JSON path, syntax errors
with line:col.

Python's json keeps the last of two duplicate keys silently; DeepSpeed refuses them late. Python's json
also reads NaN and Infinity, which are not JSON and which no DeepSpeed setting means. Here they are
found up front so a user sees every problem before any rank starts.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from harness.errors import ConfigError, Problem, UsageError

_DUPES = "\x00duplicate_keys"


class _NonFinite(str):
    """Stands in for NaN / Infinity / 1e400 while parsing, so the walk below can report its path."""


def _parse_float(text: str) -> float:
    value = float(text)
    return _NonFinite(text) if math.isinf(value) else value


def _pairs_hook(pairs: list[tuple[str, object]]) -> dict:
    out: dict = {}
    dupes: list[str] = []
    for key, value in pairs:
        if key in out:
            dupes.append(key)
        out[key] = value
    if dupes:
        out[_DUPES] = dupes
    return out


def join_path(parent: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{parent}[{key}]"
    return f"{parent}.{key}" if parent else str(key)


_MISSING = object()


def _lookup(data: dict, dotted: str):
    node = data
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return _MISSING
        node = node[key]
    return node


def get_path(data: dict, dotted: str):
    """The value at a dotted path, or None when any part is missing."""
    value = _lookup(data, dotted)
    return None if value is _MISSING else value


def has_path(data: dict, dotted: str) -> bool:
    """Whether the dotted path is written (even as null)."""
    return _lookup(data, dotted) is not _MISSING


def setdefault_path(data: dict, dotted: str, value) -> None:
    """Set the value at a dotted path unless one is there, creating the parents."""
    node = data
    *parents, leaf = dotted.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node.setdefault(leaf, value)


def pop_path(data: dict, dotted: str) -> tuple[bool, object]:
    """Remove the value at a dotted path: (found, value)."""
    *parents, leaf = dotted.split(".")
    parent = get_path(data, ".".join(parents)) if parents else data
    if isinstance(parent, dict) and leaf in parent:
        return True, parent.pop(leaf)
    return False, None


def _collect_problems(node: object, path: str, found: list[Problem]) -> None:
    if isinstance(node, _NonFinite):
        found.append(Problem(path, f"{node} is not a finite number (Python's json reads it, DeepSpeed would train with it)",
                             "write a finite number"))
    elif isinstance(node, dict):
        for key in node.pop(_DUPES, []):
            found.append(Problem(join_path(path, key), f"duplicate key {key!r} (JSON keeps only the last value)",
                                 "keep one entry for this key"))
        for key, value in node.items():
            _collect_problems(value, join_path(path, key), found)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _collect_problems(value, join_path(path, i), found)


def parse_json(text: str, source: str) -> dict:
    """Parse a JSON object; raise ConfigError for syntax errors, duplicate keys, NaN, or a non-object root."""
    try:
        data = json.loads(text, object_pairs_hook=_pairs_hook, parse_constant=_NonFinite,
                          parse_float=_parse_float)
    except json.JSONDecodeError as e:
        raise ConfigError([Problem("", f"invalid JSON at line {e.lineno} column {e.colno}: {e.msg}",
                                   "fix the JSON syntax (trailing commas and comments are not allowed)")],
                          source) from None
    problems: list[Problem] = []
    _collect_problems(data, "", problems)
    if problems:
        raise ConfigError(problems, source)
    if not isinstance(data, dict):
        raise ConfigError([Problem("", f"top level must be a JSON object, got {type(data).__name__}")], source)
    return data


def load_json(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{path}: no such file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError([Problem("", f"not UTF-8 text (byte {e.start}: {e.object[e.start:e.start + 1]!r})",
                                   "save the file as UTF-8 JSON")], str(path)) from None
    except OSError as e:
        raise UsageError(f"{path}: cannot read ({e.strerror})") from None
    return parse_json(text, str(path))


def dump_json(data: dict) -> str:
    return json.dumps(data, indent=2) + "\n"
