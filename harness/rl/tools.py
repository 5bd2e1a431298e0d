"""Tools and environments in TRL 1.16's contract (`rl.tools`, `rl.environment_factory`), so TRL environment files
run unchanged:

- `rl.tools`: functions named `file.py:name` / `module:name` (relative to the working folder, as rl.rewards);
  their schemas are transformers' (`get_json_schema`: type hints and a Google-style docstring with Args);
- `rl.environment_factory`: a class `file.py:Name`, or a mapping {name: class} picked by each row's `environment`
  column (not passed to reset). One instance per rollout, pooled and reused across generations (TRL's "construct
  once, reset often"); `reset(**row)` gets the dataset row and may return an observation appended to the last
  message of the prompt; its public methods (not reset, get_reward, _private) are the rollout's tools beside
  rl.tools; an optional `get_reward()` is a reward named after the class (weight 1) that scores its own rollouts;
- a tool that raises answers the model {"error": str(exception)} and counts in tools/failure_frequency (TRL's);
  a tool past `rl.tool_timeout_s` (the harness's key; null: no limit, TRL's) follows rl.reward_errors: stop ends the
  run naming the row, zero ends the row (finish "error", its rewards 0) and counts it in tools/timeouts.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from dataclasses import dataclass, field
from pathlib import Path

from harness.errors import UsageError
from harness.rl.rewards.functions import resolve

ENV_COLUMN = "environment"  # the row's column that picks its environment when rl.environment_factory is a mapping
NOT_TOOLS = ("reset", "get_reward")


class ToolTimeout(Exception):
    """A tool call ran past rl.tool_timeout_s."""


def schema(fn, where: str) -> dict:
    """transformers' JSON schema of a tool (what apply_chat_template(tools=[fn]) renders)."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as err:  # noqa: BLE001 - transformers' DocstringParsingException / TypeHintParsingException
        raise UsageError(f"{where}: {getattr(fn, '__qualname__', fn)} has no tool schema: {err}\n    fix: give "
                         "every argument a type hint and the docstring an Args: section naming each (transformers' "
                         "get_json_schema, as TRL's tools need)") from None


def methods(instance) -> list:
    """An environment's tools: its public bound methods except reset and get_reward (TRL's rule)."""
    return [m for name, m in inspect.getmembers(instance, predicate=inspect.ismethod)
            if name not in NOT_TOOLS and not name.startswith("_")]


@dataclass
class Toolbox:
    """The run's tools and environment classes, with one pool of instances per environment."""

    tools: list  # rl.tools' functions (every rollout has them)
    factories: dict | None  # {name or None: class}; None: no environment
    schemas: dict = field(default_factory=dict)  # {environment name or None: [tool schemas]}
    pools: dict = field(default_factory=dict)  # {environment name: [instances]}

    @property
    def multi(self) -> bool:
        return self.factories is not None and None not in self.factories

    def env_name(self, columns: dict, i: int, where: str):
        if not self.multi:
            return None
        name = (columns.get(ENV_COLUMN) or [None] * (i + 1))[i]
        if name not in self.factories:
            raise UsageError(f"{where}: environment {name!r} is not one of rl.environment_factory's "
                             f"{sorted(self.factories)}\n    fix: set the row's {ENV_COLUMN!r} column to one of them")
        return name

    def environments(self, names: list) -> list:
        """One instance per rollout, drawn from the pools (grown when a generation needs more)."""
        if self.factories is None:
            return []
        cursor, out = {}, []
        for name in names:
            pool, k = self.pools.setdefault(name, []), cursor.get(name, 0)
            if k == len(pool):
                pool.append(self.factories[name]())
            cursor[name] = k + 1
            out.append(pool[k])
        return out

    def callables(self, environment) -> dict:
        """{tool name: callable} of one rollout."""
        found = list(self.tools) + (methods(environment) if environment is not None else [])
        return {fn.__name__: fn for fn in found}

    def reward_functions(self) -> list[tuple[str, object]]:
        """(class name, reward function) of each environment class with get_reward: it scores the rollouts of its
        own class and gives None (not applicable) to the others, as TRL's."""
        out, seen = [], set()
        for cls in (self.factories or {}).values():
            if cls in seen or not callable(getattr(cls, "get_reward", None)):
                continue
            seen.add(cls)

            def get_reward(environments, _cls=cls, **kwargs):
                return [e.get_reward() if type(e) is _cls else None for e in environments]

            get_reward.__name__ = cls.__name__
            out.append((cls.__name__, get_reward))
        return out


def load_toolbox(rl: dict, base_dir: Path) -> Toolbox | None:
    """rl.tools and rl.environment_factory loaded and probed (one instance of each environment, as TRL's trainer
    does at start): None when the run has neither. UsageError (exit 2) for a bad entry."""
    entries, factory = rl.get("tools") or [], rl.get("environment_factory")
    if not entries and not factory:
        return None
    tools = [resolve(spec, base_dir, f"rl.tools[{i}]", kind="tool") for i, spec in enumerate(entries)]
    box = Toolbox(tools, None)
    for i, fn in enumerate(tools):
        schema(fn, f"rl.tools[{i}]")
    if factory:
        specs = {None: factory} if isinstance(factory, str) else dict(factory)
        box.factories = {}
        for name, spec in specs.items():
            where = "rl.environment_factory" + (f".{name}" if name is not None else "")
            cls = resolve(spec, base_dir, where, kind="environment class")
            try:
                probe = cls()
            except Exception as err:  # noqa: BLE001 - the user's constructor
                raise UsageError(f"{where}: {spec}() raised {type(err).__name__}: {err}\n    fix: an environment "
                                 "class must construct with no arguments (TRL calls environment_factory())") from None
            if not callable(getattr(probe, "reset", None)):
                raise UsageError(f"{where}: {spec} has no reset method\n    fix: define reset(self, **row) "
                                 "(TRL's contract: it gets the dataset row, may return an observation)")
            box.factories[name], box.pools[name] = cls, [probe]
    for name in (box.factories or {None: None}):
        env = box.pools[name][0] if box.factories else None
        box.schemas[name] = [schema(fn, _where(name)) for fn in box.callables(env).values()]
        if not box.schemas[name]:
            raise UsageError(f"{_where(name)}: no tools (rl.tools is empty and the environment has no public "
                             "method)\n    fix: add rl.tools, or public methods to the environment class")
    return box


def _where(name) -> str:
    return "rl.tools" if name is None else f"rl.environment_factory.{name}"


def call(fn, arguments: dict, timeout_s: float | None):
    """(result, failed): TRL's {"error": str(e)} for a tool that raises or takes bad arguments; ToolTimeout past
    timeout_s (the call is left running in a daemon thread: Python cannot stop it)."""
    def run():
        out = fn(**arguments)
        return asyncio.run(out) if inspect.isawaitable(out) else out

    if timeout_s is None:
        try:
            return run(), False
        except Exception as err:  # noqa: BLE001 - the model's call or the user's tool: the model reads the error
            return {"error": str(err)}, True
    box: dict = {}

    def target():
        try:
            box["result"] = run()
        except Exception as err:  # noqa: BLE001
            box["error"] = err

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise ToolTimeout(f"{getattr(fn, '__qualname__', fn)} ran past rl.tool_timeout_s {timeout_s}")
    if "error" in box:
        return {"error": str(box["error"])}, True
    return box["result"], False


def message(name: str, result) -> dict:
    """TRL's tool message: a list of content blocks as given, anything else as its str()."""
    return {"role": "tool", "name": name, "content": result if isinstance(result, list) else str(result)}
