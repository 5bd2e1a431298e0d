"""Files a run reads may come from elsewhere (a shared checkpoint, a downloaded recipe): recipes and configs are
parsed as JSON only, every torch.load loads tensors and plain data only (weights_only=True), and the RNG state a
checkpoint holds is written so that such a load restores it exactly."""
from __future__ import annotations

import ast
import random
from pathlib import Path

import numpy as np
import torch

from harness.checkpoint.save import _rng_state, _set_rng_state

HARNESS = Path(__file__).resolve().parents[1] / "harness"
SOURCES = sorted(HARNESS.rglob("*.py"))


def torch_load_calls() -> list[tuple[str, bool]]:
    """(where, weights_only=True?) for every torch.load(...) call in the package, however it is wrapped."""
    found = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"):
                safe = any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                           for k in node.keywords)
                found.append((f"{path.relative_to(HARNESS.parent)}:{node.lineno}", safe))
    return found


def test_every_torch_load_is_weights_only():
    loads = torch_load_calls()
    assert loads, "the scan found nothing: the pattern is wrong"
    unsafe = [where for where, safe in loads if not safe]
    assert not unsafe, "torch.load without weights_only=True:\n" + "\n".join(unsafe)


UNSAFE_MODULES = {"pickle", "marshal", "yaml", "dill", "shelve"}
WRITE_ONLY = {"yaml"}  # may be imported by a module that only writes with it (harness k8s's manifests)


def reads_with(tree: ast.AST, module: str) -> bool:
    """Whether the module touches any loading part of `module` (yaml.load, safe_load, full_load, *Loader...)."""
    return any(isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == module
               and ("load" in n.attr.lower()) for n in ast.walk(tree))


def test_no_other_deserializer_of_code_or_objects():
    """No module that unpickles or evaluates is imported, and no builtin eval/exec is called (found by AST, so
    a comment that names one does not count). yaml only where it writes and never loads (`import yaml`, no
    yaml.*load*/Loader)."""
    found = []
    for path in SOURCES:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n.split(".")[0] in UNSAFE_MODULES and not (
                    isinstance(node, ast.Import) and n in WRITE_ONLY and not reads_with(tree, n)) for n in names):
                found.append(f"{path.relative_to(HARNESS.parent)}:{node.lineno}: imports {names}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("eval", "exec"):
                found.append(f"{path.relative_to(HARNESS.parent)}:{node.lineno}: calls {node.func.id}()")
    assert not found, "\n".join(found)


def test_rng_state_round_trips_through_a_weights_only_load(tmp_path):
    random.seed(3), np.random.seed(5), torch.manual_seed(7)
    np.random.randn()  # a cached Gaussian is part of numpy's state too
    torch.save(_rng_state(), tmp_path / "rng_rank0.pt")
    expected = (random.random(), np.random.randn(4).tolist(), torch.rand(3).tolist())
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    _set_rng_state(torch.load(tmp_path / "rng_rank0.pt", weights_only=True))
    assert (random.random(), np.random.randn(4).tolist(), torch.rand(3).tolist()) == expected


def test_errors_never_print_a_secret_from_the_environment(monkeypatch, capsys):
    """A quoted library error may carry a token (a URL, a header): what harness/run.py prints masks it."""
    from harness.run import main

    secret = "hf_quotedSecret0123456789"
    monkeypatch.setenv("HF_TOKEN", secret)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["--ds-config", f"/no/such/dir/{secret}.json"]) == 2
    err = capsys.readouterr().err
    assert secret not in err and "/no/such/dir/<$HF_TOKEN>.json: no such file" in err


class _ByGetattr:
    """Pickles as getattr(target, name), as Python 3.11.0-3.11.4 pickle enum members (ZeroStageEnum)."""

    def __init__(self, target, name):
        self.target, self.name = target, name

    def __reduce__(self):
        return getattr, (self.target, self.name)


def test_optimizer_states_with_enums_pickled_by_getattr_load_and_nothing_else_does(tmp_path):
    import pytest
    from deepspeed.runtime.zero.config import ZeroStageEnum

    from harness.errors import UsageError

    from harness.checkpoint.export.ckpt_tensors import MappedFiles

    good, bad = tmp_path / "good.pt", tmp_path / "bad.pt"
    torch.save({"zero_stage": _ByGetattr(ZeroStageEnum, "gradients"), "t": torch.ones(2)}, good)
    assert MappedFiles()[good]["zero_stage"] is ZeroStageEnum.gradients
    torch.save({"escape": _ByGetattr(ZeroStageEnum, "__class__")}, bad)
    with pytest.raises(UsageError, match="only ZeroStageEnum members"):
        MappedFiles()[bad]


def test_the_write_only_exception_still_catches_a_yaml_load():
    assert reads_with(ast.parse("import yaml\nyaml.safe_load('a: 1')"), "yaml")
    assert reads_with(ast.parse("import yaml\nyaml.load(s, Loader=yaml.FullLoader)"), "yaml")
    assert not reads_with(ast.parse("import yaml\nyaml.dump_all([], Dumper=yaml.SafeDumper)"), "yaml")
