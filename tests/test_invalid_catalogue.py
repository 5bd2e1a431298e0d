"""The catalogue of invalid inputs: tests/invalid/{ds,recipes}/NAME.json, one mistake each.

tests/invalid/expected.json maps each file to the exact problem path the CLI reports and a fragment of its
message (or fix); optional world_size / model are passed as --world-size / --model, optional num_problems
(default 1) says how many problems the one mistake yields. Every case runs the real `harness validate`
in-process, and none of them may create a torch.distributed process group.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.cli import main

CATALOGUE = Path(__file__).parent / "invalid"
EXPECTED = json.loads((CATALOGUE / "expected.json").read_text())


def problem_blocks(stderr: str) -> dict[str, list[str]]:
    """'  path: message' lines (each with its '    fix:' line) grouped by path."""
    blocks: dict[str, list[str]] = {}
    current = None
    for line in stderr.splitlines():
        if line.startswith("    fix: ") and current is not None:
            current[-1] += "\n" + line
        elif line.startswith("  ") and ": " in line:
            path, _ = line[2:].split(": ", 1)
            current = blocks.setdefault(path, [])
            current.append(line)
    return blocks


def test_catalogue_is_complete():
    files = {p.relative_to(CATALOGUE).as_posix() for p in CATALOGUE.glob("*/*.json")}
    assert files == set(EXPECTED), "every catalogue file needs an expected.json entry and vice versa"
    assert len(files) >= 34
    assert {f.split("/")[0] for f in files} == {"ds", "recipes"}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_invalid_input_is_reported(name, capsys):
    case = EXPECTED[name]
    argv = ["validate", str(CATALOGUE / name)]
    if "world_size" in case:
        argv += ["--world-size", str(case["world_size"])]
    if "model" in case:  # a preset or known name, or a config folder in the catalogue (models/NAME)
        folder = CATALOGUE / case["model"]
        argv += ["--model", str(folder) if folder.is_dir() else case["model"]]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in err + out
    assert "valid" not in out, out
    num = case.get("num_problems", 1)
    assert f"{CATALOGUE / name}: {num} problem{'s' if num != 1 else ''}\n" in err, err
    blocks = problem_blocks(err)
    assert case["path"] in blocks, f"path {case['path']!r} not reported:\n{err}"
    assert any(case["fragment"] in b for b in blocks[case["path"]]), f"{case['fragment']!r} not in:\n{err}"


def test_several_files_in_one_call_report_every_file(capsys):
    names = [n for n in sorted(EXPECTED) if not {"world_size", "model"} & EXPECTED[n].keys()][:6]
    assert main(["validate", *(str(CATALOGUE / n) for n in names)]) == 2
    err = capsys.readouterr().err
    assert all(f"{CATALOGUE / n}: " in err for n in names)


def test_validation_does_not_even_import_torch_or_deepspeed():
    """Checked in a fresh interpreter: this test process may have imported torch for other tests."""
    code = ("import sys; from harness.cli import main; "
            f"main(['validate', *{[str(CATALOGUE / n) for n in sorted(EXPECTED)]!r}, '--world-size', '8']); "
            "print(sorted(m for m in ('torch', 'deepspeed', 'transformers') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout + proc.stderr


def test_no_process_group_was_created():
    """Runs after the cases above (file order): validation never creates a torch.distributed process group."""
    import torch.distributed as dist

    assert not dist.is_available() or not dist.is_initialized()
