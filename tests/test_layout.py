"""The package layout holds: imports only go downward, config/ and planner/ stay pure, no cycles, small modules."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "harness"
PURE = ("config", "planner")
ENGINE_SIDE = ("harness.train", "harness.profiling", "harness.report", "harness.commands", "harness.run",
               "harness.cli", "deepspeed", "torch.distributed")
MAX_LINES = 400


MODULES: dict[str, Path] = {}


def module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES.update({module_name(p): p for p in PKG.rglob("*.py") if "assets" not in p.parts})


def imports_of(path: Path) -> list[tuple[str, bool]]:
    """(imported module, at module level?) for every import in the file, lazy ones included."""
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = [f"{node.module}.{a.name}" for a in node.names]
            # `from pkg import submodule` needs the submodule, not the package's __init__ re-exports
            named = [m for m in subs if m in MODULES] or [node.module]
            found += [(m, id(node) in top) for m in named + subs]
    return found


@pytest.mark.parametrize("folder", PURE)
def test_pure_folders_never_import_the_engine_side(folder):
    bad = [(name, imported) for name, path in MODULES.items() if name.startswith(f"harness.{folder}")
           for imported, _ in imports_of(path) if imported.startswith(ENGINE_SIDE)]
    assert not bad, f"harness/{folder} must stay pure (no torch.distributed, deepspeed, train/...): {bad}"


def test_no_import_cycles_at_module_level():
    graph = {name: {imp for imp, top in imports_of(path) if top and imp in MODULES and imp != name}
             for name, path in MODULES.items()}
    state: dict[str, int] = {}

    def visit(node, stack):
        state[node] = 1
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for name in graph:
        if name not in state:
            visit(name, [name])


def test_every_folder_says_what_it_owns():
    for init in PKG.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc) > 40, f"{init} needs a docstring saying what the folder owns"


def test_no_module_over_the_size_limit():
    big = {str(p.relative_to(PKG.parent)): n for p in MODULES.values()
           if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines (split them by concern): {big}"


def test_top_level_keeps_only_entry_points_and_ground_floor_helpers():
    loose = {p.stem for p in PKG.glob("*.py")}
    assert loose == {"__init__", "run", "cli", "errors", "model_shapes", "ops"}, loose


def test_every_rank_script_ends_without_interpreter_finalization():
    """A script that starts a process group and ends through sys.exit can abort a rank that has finished everything
    (gloo worker thread at finalization: "terminate called without an active exception", exit -6; CI saw it on
    bench/pipe_probe.py). Every such script ends through harness.train.dist.exit_now."""
    starts_group = ("distmod.init()", "init_process_group(", "deepspeed.init_distributed(")
    scripts = [p for folder in ("harness", "bench", "tests") for p in (PKG.parent / folder).rglob("*.py")
               if p != Path(__file__).resolve()]
    entry = ('if __name__ == "__main__":', "mp.spawn(", "start_processes(")  # run as a rank, not imported
    bad = [str(p.relative_to(PKG.parent)) for p in scripts
           if any(s in (text := p.read_text()) for s in starts_group) and any(e in text for e in entry)
           and "exit_now(" not in text]
    assert not bad, f"scripts that start a process group but do not end through harness.train.dist.exit_now: {bad}"
