"""Reward entries that are Python functions with TRL's signature: `module:function` (importable, the recipe's
folder on the path) or `file.py:function` (a file, relative to the recipe's folder). They are called as TRL calls
them: reward(prompts=..., completions=..., completion_ids=..., **every dataset column) -> list of float or None."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from pathlib import Path

from harness.errors import UsageError

SIGNATURE = "def reward(prompts, completions, completion_ids=None, **kwargs) -> list[float | None]"


def _bad(where: str, what: str, fix: str) -> UsageError:
    return UsageError(f"{where}: {what}\n    fix: {fix}")


def _module_from_file(path: Path, where: str):
    if not path.is_file():
        raise _bad(where, f"no such file {path}", "give the path relative to the recipe's folder, or absolute")
    name = f"harness_reward_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as err:  # noqa: BLE001 - any error while importing the user's file is a bad entry
        raise _bad(where, f"{path} does not import: {type(err).__name__}: {err}", "fix the file so that "
                   f"`python {path}` runs") from None
    return module


def _module(name: str, base_dir: Path, where: str):
    if str(base_dir) not in sys.path:
        sys.path.insert(0, str(base_dir))
    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise _bad(where, f"module {name!r} does not import ({err})",
                   f"install it, put {name.replace('.', '/')}.py in {base_dir}, or name a file: path/to/file.py:function"
                   ) from None


def resolve(spec: str, base_dir: Path, where: str, kind: str = "function"):
    """The callable `module:name` / `file.py:name` names (a reward function, a tool, an environment class)."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise _bad(where, f"{spec!r} is not module:{kind} or file.py:{kind}", "e.g. my_rewards.py:accuracy")
    module = _module_from_file(Path(base_dir) / target, where) if target.endswith(".py") else \
        _module(target, Path(base_dir), where)
    fn = getattr(module, attr, None)
    if not callable(fn):
        names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise _bad(where, f"{target} has no {kind} {attr!r}", f"one of: {', '.join(names) or '(none)'}")
    return fn


def load(spec: str, base_dir: Path, where: str):
    """The reward function an entry names, its signature checked."""
    fn = resolve(spec, base_dir, where)
    check_signature(fn, where)
    return fn


def check_signature(fn, where: str) -> None:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return  # a builtin or C callable: nothing to read, called as TRL would
    names = set(params)
    kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    missing = [n for n in ("prompts", "completions") if n not in names and not kwargs]
    if missing:
        raise _bad(where, f"{fn.__name__}{inspect.signature(fn)} takes no {', '.join(missing)} (TRL passes "
                   "prompts, completions, completion_ids and every dataset column by keyword)", SIGNATURE)


def call(fn, *, prompts, completions, completion_ids, columns: dict) -> list:
    """fn called as TRL calls it; keywords it cannot take are left out when it has no **kwargs."""
    kwargs = {"prompts": prompts, "completions": completions, "completion_ids": completion_ids, **columns}
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return fn(**kwargs)
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    return fn(**kwargs)
