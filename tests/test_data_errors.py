"""Empty and unreadable data (issue #18): exit 2 naming the file, what is in it and the fix, before any rank trains.

Every case goes through the real entry point, `harness.run.main(argv)`, in this one process (the checks run
before torch is imported, a few ms each); one case also runs as the command a user types, by path, to see the
exit code and that no traceback reaches the terminal. A bad line past the head the launch checks is found when
`datasets` fails on it, where the store is prepared: that case calls the store's `prepare`.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from harness.errors import UsageError
from harness.data.corpus import DataSpec
from harness.data.files import HEAD_RECORDS, check_local

from helpers.launch import ROOT, env


def write(path, text: str):
    path.write_text(text)
    return path


def parquet(path, rows: list[dict], columns=("text",)):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({c: pa.array([r[c] for r in rows], pa.string()) for c in columns})
    pq.write_table(table, path)
    return path


def make_cases(tmp):
    (tmp / "no_data").mkdir()
    write(tmp / "no_data" / "README.md", "not data")
    (tmp / "nothing").mkdir()
    late_text = "".join(json.dumps({"body": f"doc {i}"}) + "\n" for i in range(HEAD_RECORDS)) + '{"text": "x"}\n'
    cases = [(tmp / f"empty{ext}", "is empty (0 bytes)") for ext in (".txt", ".json", ".jsonl", ".csv", ".parquet")]
    for path, _ in cases:
        path.touch()
    return cases + [
        (write(tmp / "blank.jsonl", "\n  \n\n"), "has only blank lines: no records"),
        (write(tmp / "blank.txt", "\n\n \t\n"), "has only blank lines: no text"),
        (write(tmp / "blank.csv", "\n\n"), "has only blank lines: no header, no rows"),
        (write(tmp / "late_text.jsonl", late_text),
         f"has no column 'text' (train.text_field, format 'text') in its first {HEAD_RECORDS} records; their columns "
         "are: body"),
        (write(tmp / "bad_line.jsonl", '{"text": "a"}\n\n{"text": "b"}\n{"text": "c",\n'),
         "line 4 is not JSON: Expecting property name enclosed in double quotes at column 14"),
        (write(tmp / "scalar_line.jsonl", '{"text": "a"}\n7\n'), "line 2 is a JSON int, not an object"),
        (write(tmp / "bad_array.json", '[\n {"text": "a"},\n {"text": "b"}\n {"text": "c"}\n]\n'),
         "is not valid JSON: Expecting ',' delimiter at line 4, column 2"),
        (write(tmp / "empty_array.json", "[]\n"), "holds an empty JSON array: no records"),
        (write(tmp / "header_only.csv", "text,id\n"), "has a header (text, id) and no rows"),
        (parquet(tmp / "no_rows.parquet", []), "has no rows (columns: text)"),
        (write(tmp / "not.parquet", "text\nhello\n"), "is not a readable parquet file"),
        (tmp / "no_data", "has no data files: it holds 1 other files (README.md)"),
        (tmp / "nothing", "has no data files: it is empty"),
    ]


def test_every_case_exits_2_naming_file_finding_and_fix_before_any_rank(tmp_path, capsys, monkeypatch):
    from harness import run

    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    failures = []
    for path, finding in make_cases(tmp_path):
        code = run.main(["--recipe", "zero2", "--dataset", str(path), "--output-dir", str(tmp_path / "run")])
        err = capsys.readouterr().err
        if code != 2 or str(path) not in err or finding not in err or "    fix: " not in err or "Traceback" in err:
            failures.append(f"{path.name}: exit {code}, want 2 with {finding!r}\n{err}")
    assert not failures, "\n".join(failures)
    assert not (tmp_path / "run").exists(), "a bad dataset got as far as the run folder"
    assert "torch.distributed" not in sys.modules or not sys.modules["torch.distributed"].is_initialized()


def test_the_command_a_user_types_exits_2_without_a_traceback(tmp_path):
    (tmp_path / "empty.jsonl").touch()
    proc = subprocess.run([sys.executable, "harness/run.py", "--recipe", "zero2", "--dataset",
                           str(tmp_path / "empty.jsonl")], cwd=ROOT, env={**env(), "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"data file {tmp_path / 'empty.jsonl'} is empty (0 bytes)" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout and "StopIteration" not in proc.stderr


def test_valid_files_of_every_format_pass_the_check(tmp_path):
    rows = [{"text": f"document {i}"} for i in range(3)]
    files = [write(tmp_path / "a.jsonl", "".join(json.dumps(r) + "\n" for r in rows)),
             write(tmp_path / "a.json", json.dumps(rows, indent=1)),
             write(tmp_path / "a.txt", "one\n\ntwo\n"), write(tmp_path / "a.csv", "id,text\n1,hello\n"),
             parquet(tmp_path / "a.parquet", rows)]
    for path in files:
        check_local(DataSpec(dataset=str(path)))
    instruction = write(tmp_path / "i.jsonl", json.dumps({"prompt": "q", "response": "a"}) + "\n")
    check_local(DataSpec(dataset=str(instruction), format="instruction"))
    with pytest.raises(UsageError, match=r"has no column 'response' \(train.response_field, format 'instruction'\)"):
        check_local(DataSpec(dataset=str(write(tmp_path / "j.jsonl", '{"prompt": "q"}\n')), format="instruction"))


def test_a_bad_line_past_the_checked_head_is_named_when_the_store_is_prepared(tmp_path):
    from harness.model.hf import load_tokenizer
    from harness.data.store import prepare

    good = "".join(json.dumps({"text": f"document number {i}"}) + "\n" for i in range(HEAD_RECORDS + 40))
    path = write(tmp_path / "late_bad.jsonl", good + '{"text": oops}\n')
    spec = DataSpec(dataset=str(path))
    check_local(spec)  # the head is fine: the launch's check lets it through
    with pytest.raises(UsageError, match=f"line {HEAD_RECORDS + 41} is not JSON: Expecting value at column 10"):
        prepare(spec, load_tokenizer("tiny-llama"), 16, str(tmp_path / "stores"), num_proc=1)
    assert not list((tmp_path / "stores").glob("*/meta.json")), "a store was published for a corpus that failed"
