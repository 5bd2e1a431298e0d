"""What a local data file holds, checked cheaply before any rank trains (and before `datasets` reads it).

`datasets` meets an empty or malformed file deep in its builders (a 0-byte jsonl: StopIteration in the json
builder; a bad line: an ArrowInvalid with a byte offset), after the process group exists. These checks read
only each file's head (HEAD_RECORDS records or HEAD_BYTES, a parquet file's footer) and say, as a UsageError
(exit 2), the file, what was found there and the fix: an empty file, only blank lines, a line that is not JSON
(by line number), a JSON array with no records, a csv with a header and no rows, a parquet file with no rows
or that is not parquet, and the columns the format reads missing from the first records. A bad line past the
head is found when `datasets` fails on it: `load_failure` then scans the file for it.
"""

from __future__ import annotations

import csv
import itertools
import json
from pathlib import Path

from harness.errors import UsageError
from harness.data.corpus import BUILTIN, DataSpec, local_source

HEAD_RECORDS = 100
HEAD_BYTES = 4 << 20
WHOLE_JSON_BYTES = 256 << 20  # a .json document (not JSON lines) is parsed whole up to this size


def _problem(path: Path, found: str, fix: str) -> UsageError:
    return UsageError(f"data file {path} {found}\n    fix: {fix}")


def _blank_only(path: Path) -> bool:
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            if chunk.strip():
                return False
    return True


def _empty_fix(spec: DataSpec, builder: str) -> str:
    column = next(iter(spec.columns.values()))
    shape = {"text": "one document per line", "json": f'one {{"{column}": ...}} object per line',
             "csv": f"a header naming {column!r}, then one row per record",
             "parquet": f"a table with a {column!r} column"}[builder]
    return f"add records to it ({shape}), or remove it / point train.dataset at the data"


def _check_columns(path: Path, spec: DataSpec, records: list[dict], what: str) -> None:
    keys = list(dict.fromkeys(k for r in records for k in r))
    for recipe_key, column in spec.columns.items():
        if not any(r.get(column) is not None for r in records):
            fix = (spec.column_fix(recipe_key) if spec.preference else f"set train.{recipe_key} to the key that "
                   f"holds it (--set train.{recipe_key}=NAME), or train.format to the format of these records")
            raise _problem(path, f"has no column {column!r} ({spec.column_note(recipe_key)}) in its first "
                           f"{len(records)} {what}; their columns are: {', '.join(keys) or '(none)'}", fix)


def _json_lines_head(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of the first non-blank lines, within HEAD_RECORDS and HEAD_BYTES."""
    out, read = [], 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, start=1):
            read += len(line)
            if line.strip():
                out.append((number, line))
            if len(out) >= HEAD_RECORDS or read >= HEAD_BYTES:
                break
    return out


def _bad_line(path: Path, number: int, line: str, err: json.JSONDecodeError | None) -> UsageError:
    what = f"{err.msg} at column {err.colno}" if err else f"a JSON {type(json.loads(line)).__name__}, not an object"
    shown = line.strip()[:80]
    return _problem(path, f"is not valid JSON lines: line {number} is {'not JSON: ' if err else ''}{what} "
                    f"({shown!r})", f"fix or remove line {number}: every non-blank line of a JSON lines file must "
                    "be one JSON object, e.g. {\"text\": \"...\"}")


def _parse_line(path: Path, number: int, line: str) -> dict:
    try:
        record = json.loads(line.rstrip("\r\n"))
    except json.JSONDecodeError as e:
        raise _bad_line(path, number, line, e) from None
    if not isinstance(record, dict):
        raise _bad_line(path, number, line, None)
    return record


def _json_document(path: Path, spec: DataSpec) -> None:
    """A .json file holding one JSON value (an array of records), as `datasets` falls back to reading it."""
    if path.stat().st_size > WHOLE_JSON_BYTES:
        return  # too large to parse here twice; `datasets` reports it (load_failure names the line)
    try:
        value = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except json.JSONDecodeError as e:
        raise _problem(path, f"is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}",
                       f"fix line {e.lineno}; a .json file is one array of objects or one object per line") from None
    records = value if isinstance(value, list) else None
    if records is None or not all(isinstance(r, dict) for r in records[:HEAD_RECORDS]):
        raise _problem(path, f"holds a JSON {type(value).__name__}, not an array of objects or JSON lines",
                       "write one object per line (JSON lines), or an array of objects")
    if not records:
        raise _problem(path, "holds an empty JSON array: no records", _empty_fix(spec, "json"))
    _check_columns(path, spec, records[:HEAD_RECORDS], "records")
    _check_records(path, spec, None, records[:HEAD_RECORDS])


def _check_records(path: Path, spec: DataSpec, numbers: list[int] | None, records: list[dict]) -> None:
    """sharegpt / alpaca / preference: the first malformed record of the head, by line (JSON lines) or record number."""
    from harness.data.formats import record_fix, record_problem

    for i, record in enumerate(records):
        if problem := record_problem(spec, record):
            where = f"line {numbers[i]}" if numbers is not None else f"record {i + 1}"
            kind = "preference" if spec.preference else spec.format
            raise _problem(path, f"{where} is not a valid {kind} record: {problem}", record_fix(spec))


def _check_json(path: Path, spec: DataSpec) -> None:
    head = _json_lines_head(path)
    if not head:
        raise _problem(path, "has only blank lines: no records", _empty_fix(spec, "json"))
    if path.suffix.lower() == ".json" and head[0][1].lstrip().startswith("["):
        return _json_document(path, spec)
    records = [_parse_line(path, number, line) for number, line in head]
    _check_columns(path, spec, records, "records")
    _check_records(path, spec, [number for number, _ in head], records)


def _check_csv(path: Path, spec: DataSpec) -> None:
    with open(path, newline="", encoding="utf-8", errors="replace") as f:
        rows = [r for r in itertools.islice(csv.reader(f), HEAD_RECORDS + 1) if any(c.strip() for c in r)]
    if not rows:
        raise _problem(path, "has only blank lines: no header, no rows", _empty_fix(spec, "csv"))
    header, body = rows[0], rows[1:]
    if not body:
        raise _problem(path, f"has a header ({', '.join(header)}) and no rows", _empty_fix(spec, "csv"))
    _check_columns(path, spec, [dict(zip(header, r)) for r in body], "rows")


def _check_parquet(path: Path, spec: DataSpec) -> None:
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(path).metadata
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... for a file that is not parquet
        raise _problem(path, f"is not a readable parquet file ({type(e).__name__}: {str(e).splitlines()[0]})",
                       "write it with pandas.DataFrame.to_parquet / pyarrow.parquet.write_table, or use "
                       ".jsonl") from None
    names = meta.schema.to_arrow_schema().names  # top-level columns (schema.names lists nested leaves)
    if meta.num_rows == 0:
        raise _problem(path, f"has no rows (columns: {', '.join(names)})", _empty_fix(spec, "parquet"))
    for recipe_key, column in spec.columns.items():
        if column not in names:
            raise _problem(path, f"has no column {column!r} ({spec.column_note(recipe_key)}); its "
                           f"columns: {', '.join(names)}", spec.column_fix(recipe_key))


def check_local(spec: DataSpec) -> None:
    """Raise UsageError naming the first local file that would give `datasets` nothing to read (or fail it)."""
    local = local_source(spec.dataset, spec.builtin_pairs)
    if local is None or spec.dataset == BUILTIN:
        return
    builder, files = local
    spec.columns  # an unknown format fails first, with its own message
    for name in files:
        path = Path(name)
        if path.stat().st_size == 0:
            raise _problem(path, "is empty (0 bytes)", _empty_fix(spec, builder))
        if builder == "text":
            if _blank_only(path):
                raise _problem(path, "has only blank lines: no text", _empty_fix(spec, "text"))
        else:
            {"json": _check_json, "csv": _check_csv, "parquet": _check_parquet}[builder](path, spec)


def load_failure(spec: DataSpec, err: Exception) -> UsageError | None:
    """A UsageError for a local source `datasets` failed to load: the first bad JSON line past the checked
    head, or the file list and datasets' own reason. None for a hub dataset (its errors are reported as is)."""
    local = local_source(spec.dataset, spec.builtin_pairs)
    if local is None:
        return None
    builder, files = local
    if builder == "json":
        for name in files:
            head = _json_lines_head(Path(name))
            if Path(name).suffix.lower() == ".json" and head and head[0][1].lstrip().startswith("["):
                continue  # a JSON document: its own check named the line already
            try:
                with open(name, encoding="utf-8", errors="replace") as f:
                    for number, line in enumerate(f, start=1):
                        if line.strip():
                            _parse_line(Path(name), number, line)
            except UsageError as e:  # the first bad line
                return e
    reason = next((str(e).splitlines()[0] for e in (err, err.__cause__, err.__context__) if e and str(e)), "")
    where = files[0] if len(files) == 1 else f"{len(files)} files under {spec.dataset}"
    return UsageError(f"datasets could not read {where} as {builder} ({type(err).__name__}: "
                      f"{reason})\n    fix: check the file's format matches its extension ({builder})")


def _head_of(path: Path, builder: str) -> tuple[list[str], list[dict]]:
    """(where each record is, in words; the records) of a file's head, as `datasets` will read them."""
    if builder == "json":
        head = _json_lines_head(path)
        if path.suffix.lower() == ".json" and head and head[0][1].lstrip().startswith("["):
            if path.stat().st_size > WHOLE_JSON_BYTES:
                return [], []
            records = json.loads(path.read_text(encoding="utf-8", errors="replace"))[:HEAD_RECORDS]
            return [f"record {i + 1}" for i in range(len(records))], records
        return [f"line {number}" for number, _ in head], [_parse_line(path, number, line) for number, line in head]
    if builder == "parquet":
        import pyarrow.parquet as pq

        batch = next(pq.ParquetFile(path).iter_batches(batch_size=HEAD_RECORDS), None)
        records = batch.to_pylist() if batch is not None else []
        return [f"row {i + 1}" for i in range(len(records))], records
    if builder == "csv":
        with open(path, newline="", encoding="utf-8", errors="replace") as f:
            records = list(itertools.islice(csv.DictReader(f), HEAD_RECORDS))
        return [f"row {i + 1}" for i in range(len(records))], records
    return [], []


def head_records(spec: DataSpec) -> list[tuple[Path, list[str], list[dict]]]:
    """(file, where each record is, its first records) of each local file (builtin included), after check_local:
    what a check of the records' content reads before any rank trains. A hub dataset: []."""
    local = local_source(spec.dataset, spec.builtin_pairs)
    if local is None:
        return []
    builder, files = local
    return [(Path(name), *_head_of(Path(name), builder)) for name in files]
