"""The package layout holds: rooms in one order with imports only downward, no two modules importing each other,
no room over 30 % of the package, config/ and planner/ pure, small modules, docstrings that say what each room
owns and may import; each named constant defined once; the planner typed (no dict named work/hw/shape); README.md
short and linking every docs/ page, docs/recipes.md in sync."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from harness.config import recipes_doc

PKG = Path(__file__).resolve().parents[1] / "harness"
# The rooms, lowest first. A module may import from its own room or any room before it, never after it.
# top-level modules every room may use
GROUND = ("errors", "log", "dist", "ops", "startup", "model_shapes", "http_json")
ROOMS = ("ground", "config", "planner", "data", "model", "checkpoint", "profiling", "calibration", "trackers", "rl",
         "distill", "train", "report", "commands", "entry")
ENTRY = ("run", "cli", "__init__")  # harness/run.py, harness/cli.py, harness/__init__.py
PURE = ("config", "planner")
ENGINE_SIDE = tuple(f"harness.{r}" for r in ROOMS[3:-1]) + ("harness.dist", "harness.run", "harness.cli",
                                                            "deepspeed", "torch.distributed")
MAX_LINES = 400
MAX_ROOM_SHARE = 0.30


MODULES: dict[str, Path] = {}


def module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES.update({module_name(p): p for p in PKG.rglob("*.py") if "assets" not in p.parts})


def room_of(module: str) -> str:
    """harness.model.load.materialise -> model; harness.errors -> ground; harness.run -> entry."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in ENTRY:
        return "entry"
    if parts[1] in GROUND:
        return "ground"
    return parts[1]


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


def harness_imports(name: str) -> set[str]:
    """The package's modules that `name` imports, lazy imports included."""
    return {imp for imp, _ in imports_of(MODULES[name]) if imp in MODULES and imp != name}


def test_every_module_sits_in_a_named_room():
    assert set(map(room_of, MODULES)) <= set(ROOMS), set(map(room_of, MODULES)) - set(ROOMS)
    loose = {p.stem for p in PKG.glob("*.py")}
    assert loose == set(GROUND) | set(ENTRY), f"top-level modules beyond the ground floor and entry points: {loose}"


def test_imports_run_only_downward():
    up = [f"{name} ({room_of(name)}) imports {imp} ({room_of(imp)})" for name in MODULES
          for imp in sorted(harness_imports(name)) if ROOMS.index(room_of(imp)) > ROOMS.index(room_of(name))]
    assert not up, f"imports from a lower room to a higher one (rooms, lowest first: {', '.join(ROOMS)}):\n" + \
        "\n".join(up)


def test_no_two_modules_import_each_other():
    """Lazy imports included: a lazy import hides a circle from Python, not from a reader."""
    pairs = sorted({tuple(sorted((a, b))) for a in MODULES for b in harness_imports(a) if a in harness_imports(b)})
    assert not pairs, f"modules that import each other (a third module holds what they share, or merge them): {pairs}"


def test_no_import_cycles():
    graph = {name: harness_imports(name) for name in MODULES}
    state: dict[str, int] = {}

    def visit(node, stack):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_no_room_holds_more_than_its_share_of_the_package():
    lines: dict[str, int] = {}
    for name, path in MODULES.items():
        lines[room_of(name)] = lines.get(room_of(name), 0) + len(path.read_text().splitlines())
    total = sum(lines.values())
    big = {room: f"{n / total:.0%}" for room, n in lines.items() if n > MAX_ROOM_SHARE * total}
    assert not big, f"rooms over {MAX_ROOM_SHARE:.0%} of the package's {total} lines (split by concern): {big}"


@pytest.mark.parametrize("folder", PURE)
def test_pure_folders_never_import_the_engine_side(folder):
    def engine_side(imported: str) -> bool:
        return any(imported == e or imported.startswith(e + ".") for e in ENGINE_SIDE)

    bad = [(name, imported) for name, path in MODULES.items() if name.startswith(f"harness.{folder}")
           for imported, _ in imports_of(path) if engine_side(imported)]
    assert not bad, f"harness/{folder} must stay pure (no torch.distributed, deepspeed, train/...): {bad}"


@pytest.mark.parametrize("room", [r for r in ROOMS if r not in ("ground", "entry")])
def test_every_room_says_what_it_owns_and_may_import(room):
    """Each room's __init__ docstring: what it owns, then `May import: ...` naming the rooms below it that it uses;
    the line never names a room above, nor leaves out one the room's modules import."""
    doc = ast.get_docstring(ast.parse((PKG / room / "__init__.py").read_text())) or ""
    line = re.search(r"^May import:(.*?)(?:\n\n|\Z)", doc, re.M | re.S)
    assert len(doc) > 80 and line, f"harness/{room}/__init__.py: say what the room owns, then `May import: ...`"
    named = {"ground"} if "ground floor" in line.group(1) else set()
    named |= {r for r in ROOMS if re.search(rf"\b{r}/", line.group(1))}
    above = {r for r in named if ROOMS.index(r) >= ROOMS.index(room)}
    assert not above, f"harness/{room}: `May import` names rooms at or above it: {above}"
    used = {room_of(imp) for name in MODULES if room_of(name) == room for imp in harness_imports(name)} - {room}
    assert used <= named, f"harness/{room} imports {sorted(used - named)}, which its `May import` line does not name"


def test_every_subfolder_says_what_it_owns():
    for init in PKG.glob("*/*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc) > 40, f"{init} needs a docstring saying what the folder owns"


def test_no_module_over_the_size_limit():
    big = {str(p.relative_to(PKG.parent)): n for p in MODULES.values()
           if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines (split them by concern): {big}"


def test_every_rank_script_ends_without_interpreter_finalization():
    """A script that starts a process group and ends through sys.exit can abort a rank that has finished everything
    (gloo worker thread at finalization: "terminate called without an active exception", exit -6; CI saw it on
    bench/pipe_probe.py). Every such script ends through harness.dist.exit_now."""
    starts_group = ("distmod.init()", "init_process_group(", "deepspeed.init_distributed(")
    scripts = [p for folder in ("harness", "bench", "tests") for p in (PKG.parent / folder).rglob("*.py")
               if p != Path(__file__).resolve()]
    entry = ('if __name__ == "__main__":', "mp.spawn(", "start_processes(")  # run as a rank, not imported
    bad = [str(p.relative_to(PKG.parent)) for p in scripts
           if any(s in (text := p.read_text()) for s in starts_group) and any(e in text for e in entry)
           and "exit_now(" not in text]
    assert not bad, f"scripts that start a process group but do not end through harness.dist.exit_now: {bad}"


# Each fact the planner and the run share, and the one module that defines it (issue #31: "every default and
# constant lives once; the planner and the model read the same one"). The values DeepSpeed and the recipes default
# are read from their schemas there, not written again.
DEFINED_ONCE = {name: "harness.config.defaults" for name in (
    "TILE_TOKENS", "ALLGATHER_BUCKET_ELEMS", "ZERO0_ALLREDUCE_BUCKET_ELEMS", "REDUCE_BUCKET_ELEMS",
    "PREFETCH_BUCKET_ELEMS", "PARAM_PERSISTENCE_THRESHOLD", "SUB_GROUP_ELEMS", "STAGE3_MAX_LIVE_PARAMETERS",
    "MAX_REUSE_DISTANCE_ELEMS", "OPTIMIZER_SWAP_BUFFER_COUNT", "PARAM_SWAP_BUFFER_COUNT", "PARAM_SWAP_BUFFER_ELEMS",
    "MODEL_SIZED_BUCKETS", "PRECISION_BYTES", "PRECISION_DTYPES")}
DEFINED_ONCE.update({"FAMILIES": "harness.config.moe_families", "AUTOEP_FAMILIES": "harness.config.moe_families",
                     "LLAMA_LIKE": "harness.model_shapes", "ZeroBuckets": "harness.config.run_model",
                     "model_sized_buckets": "harness.config.defaults", "lora_on": "harness.config.adapter_rules",
                     "ulysses_splits_heads": "harness.model_shapes", "ulysses_splits_kv_heads": "harness.model_shapes"})
# the same facts under the names they had before (a new copy would likely take one of them)
RETIRED = ("ZERO0_BUCKET_ELEMS", "STAGE3_MAX_LIVE", "STAGE3_DEFAULT_MAX_LIVE", "TRAIN_DTYPES", "DTYPES",
           "MOE_FAMILIES", "TP_FAMILIES")
# DeepSpeed / recipe keys whose default lives in a schema: a literal number next to one of them is a second copy
SCHEMA_KEYS = {"tile_tokens", "reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
               "stage3_param_persistence_threshold", "stage3_max_live_parameters", "sub_group_size",
               "stage3_max_reuse_distance", "buffer_count", "buffer_size"}
PRECISIONS = {"bf16", "fp16", "fp32"}


def module_assignments(path: Path) -> set[str]:
    """Names bound at module level by `NAME = ...`, `NAME: type = ...`, `class NAME` or `def NAME`."""
    tree = ast.parse(path.read_text())
    names = {node.name for node in tree.body if isinstance(node, (ast.ClassDef, ast.FunctionDef))}
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) \
            else []
        names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def test_each_named_constant_is_defined_in_exactly_one_module():
    assigned = {name: module_assignments(path) for name, path in MODULES.items()}
    where = {const: sorted(m for m, names in assigned.items() if const in names) for const in DEFINED_ONCE}
    wrong = {const: mods for const, mods in where.items() if mods != [DEFINED_ONCE[const]]}
    assert not wrong, f"constants not defined exactly once, where the table says (import them instead): {wrong}"
    again = {const: mods for const in RETIRED if (mods := sorted(m for m, n in assigned.items() if const in n))}
    assert not again, f"a retired copy of a shared constant is back (import it from its one module): {again}"


def _number(node) -> bool:
    return isinstance(node, ast.Constant) and type(node.value) in (int, float)


def _size_or_dtype(node) -> bool:
    """2, "bfloat16" or torch.bfloat16: what PRECISION_BYTES / PRECISION_DTYPES map a precision to."""
    if isinstance(node, ast.Attribute):
        return isinstance(node.value, ast.Name) and node.value.id == "torch"
    return isinstance(node, ast.Constant) and (type(node.value) is int or str(node.value).endswith(("float16",
                                                                                                   "float32")))


def literal_copies(path: Path) -> list[str]:
    """A number written beside a schema key (`.get("tile_tokens", 4096)`, `"reduce_bucket_size": 5e8`,
    `tile_tokens=4096`, `tile_tokens: int = 4096`), and a precision table written out by hand."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        pairs = []
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and len(node.args) == 2 and isinstance(node.args[0], ast.Constant):
            pairs.append((node.args[0].value, node.args[1]))
        elif isinstance(node, ast.Call):
            pairs += [(k.arg, k.value) for k in node.keywords]
        elif isinstance(node, ast.Dict):
            keys = {k.value for k in node.keys if isinstance(k, ast.Constant)}
            if keys >= PRECISIONS and all(map(_size_or_dtype, node.values)):
                found.append(f"line {node.lineno}: a precision -> bytes / dtype table")
            pairs += [(k.value, v) for k, v in zip(node.keys, node.values) if isinstance(k, ast.Constant)]
        elif isinstance(node, ast.arguments):
            args = node.posonlyargs + node.args
            pairs += list(zip([a.arg for a in args[len(args) - len(node.defaults):]], node.defaults))
            pairs += [(a.arg, d) for a, d in zip(node.kwonlyargs, node.kw_defaults) if d is not None]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            pairs.append((node.target.id, node.value))
        found += [f"line {v.lineno}: {k} = {v.value}" for k, v in pairs if k in SCHEMA_KEYS and _number(v)]
    return found


def test_no_module_writes_a_shared_default_again():
    """Where a value has one home (a schema, harness/config/defaults.py), no other module writes the number: not
    beside its key, and the bucket sizes (integers of 10^7 and more, rare enough to mean one thing) nowhere."""
    from harness.config import defaults

    sizes = {v for k in DEFINED_ONCE if type(v := getattr(defaults, k, None)) is int and v >= 10**7}
    copies = {}
    for name, path in MODULES.items():
        if name == "harness.config.defaults":
            continue
        hits = literal_copies(path) + [f"line {n.lineno}: {n.value:_}" for n in ast.walk(ast.parse(path.read_text()))
                                       if isinstance(n, ast.Constant) and type(n.value) is int and n.value in sizes]
        if hits:
            copies[name] = hits
    assert not copies, f"defaults written again (read them from harness.config.defaults): {copies}"


def test_the_schemas_and_the_shared_tables_agree():
    """The recipes keep DeepSpeed's stage3_max_live_parameters (the planner prices the one value for both), and the
    precision tables cover exactly the precisions a recipe may name."""
    from harness.config.defaults import PRECISION_BYTES, PRECISION_DTYPES, STAGE3_MAX_LIVE_PARAMETERS, recipe_default
    from harness.config.schema import RECIPE_SCHEMA, subschema

    assert recipe_default("zero.stage3_max_live_parameters") == STAGE3_MAX_LIVE_PARAMETERS
    assert set(PRECISION_BYTES) == set(PRECISION_DTYPES) == set(subschema(RECIPE_SCHEMA, "precision")["enum"])


def test_no_planner_function_takes_a_dict_named_work_hw_or_shape():
    """The planner speaks typed values (issue #31): the workload is a Workload, the machines a Cluster, the model's
    shape a ModelShape (planner/inputs.py, planner/shape.py), never an untyped dict under those names."""
    import ast
    from pathlib import Path

    import harness.planner

    bad = []
    for path in Path(harness.planner.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                bad += [f"{path.name}:{node.name}({a.arg})" for a in args if a.arg in ("work", "hw", "shape")
                        and (a.annotation is None or "dict" in ast.unparse(a.annotation) or a.arg == "hw")]
    assert not bad, f"planner functions taking an untyped work/hw/shape: {bad}"


# docs/ is the floor plan: README.md stays short and links every docs/ page, every relative link resolves,
# docs/recipes.md is what `harness build` generates, and every docs/ page the code cites exists.

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
README_MAX_LINES = 200
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")  # [text](target)
CODE_DIRS = ("harness", "tests", "bench", "docker")


def links(page: Path) -> list[str]:
    """The relative link targets of a Markdown page (web links and pure anchors left out)."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # links inside code blocks are not links
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    heads = re.findall(r"^#+\s+(.*)$", page.read_text(), flags=re.M)
    return {re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", h.strip().lower())) for h in heads}


def test_readme_is_short():
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail to docs/"


def test_readme_links_every_docs_page():
    linked = {(README.parent / t.split("#")[0]).resolve() for t in links(README)}
    missing = [p.name for p in PAGES if p.resolve() not in linked]
    assert PAGES and not missing, f"docs/ pages not linked from README.md: {missing}"


@pytest.mark.parametrize("page", [README, *PAGES], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {dest.name})")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {broken}"


def test_recipes_page_is_in_sync_with_the_schema_and_recipes():
    page = ROOT / recipes_doc.DOC_PATH
    assert page.read_text() == recipes_doc.render(), "docs/recipes.md is out of date: run `harness build`"


def test_every_docs_page_the_code_cites_exists():
    """`docs/X.md` anywhere in the code, and the bare `deepspeed-facts.md` short form, name a page in docs/."""
    cited = set()
    for folder in CODE_DIRS:
        for path in (ROOT / folder).rglob("*"):
            if path.suffix not in (".py", ".json", ".sh") or path == Path(__file__).resolve():
                continue
            text = path.read_text(errors="replace")  # a test fixture may hold latin-1 on purpose
            cited |= {(m, path) for m in re.findall(r"\bdocs/([\w.-]+\.md)", text)}
            cited |= {(m, path) for m in re.findall(r"(?<![\w/])(deepspeed-facts\.md)", text)}
    assert cited, "expected the code to cite docs/deepspeed-facts.md"
    missing = sorted(f"{p.relative_to(ROOT)} cites docs/{name}" for name, p in cited if not (DOCS / name).is_file())
    assert not missing, missing
