"""The prepared preference store: every pair tokenized once, padded to seq_len, memory-mapped by every rank.

One folder per (dataset source, prompt field, tokenizer and chat template, seq_len, truncation), named by a hash
of that key beside the token stores (harness/data/store.py: same root, same atomic publish, same lock):
    chosen.bin     [pairs, seq_len] prompt + chosen completion ids, right-padded with the pad id (uint16 when the
                   vocabulary fits, else uint32)
    rejected.bin   [pairs, seq_len] prompt + rejected completion ids, padded the same way
    bounds.bin     int32 [pairs, 3]: prompt length, chosen length, rejected length (prompt included): the labels
                   are the tokens in [prompt length, side's length), nothing else is stored per token
    records.bin    int64 [pairs]: the record each pair came from (its number in the dataset, from 0)
    meta.json      the key and the counts (pairs, truncated, dropped, identical, ...); written last
Pair i is row i of these files: its index is stable for a key (the precomputed reference cache's key).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import uuid
from pathlib import Path

import numpy as np

from harness.data.corpus import DataSpec, source_fingerprint
from harness.data.preference_records import (check_pair_template, empty_after_tokens, encode_pairs, fit_pair,
                                             pair_fix, pair_problem, prompt_fills, split_pair)
from harness.data.store import (_exclusive, _one_thread_per_process, _publish, default_num_proc, dtype_for,
                                run_in_child, store_path, tokenizer_hash)
from harness.errors import UsageError

PAIRS_VERSION = 1  # bump when the layout or the tokenization rules change: old stores are not reused
BATCH_RECORDS = 1000
MIN_PAIRS_PER_PROC = 10_000  # fewer records per process: forking costs more than it saves (as store.py)
SAME_FIX = "check that the 'chosen' and 'rejected' columns hold the preferred and the dispreferred completion"
COUNTS = ("records", "pairs", "truncated", "dropped_long", "dropped_prompt", "identical", "mismatched")


def pairs_key(spec: DataSpec, tokenizer, seq_len: int, truncation: str) -> dict:
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2 for a prompt and a completion token, got {seq_len}")
    return {"version": PAIRS_VERSION, "format": "pairs", "dataset": spec.dataset, "config": spec.config,
            "split": spec.split, "dataset_fingerprint": source_fingerprint(spec), "prompt_field": spec.prompt_field,
            "tokenizer_hash": tokenizer_hash(tokenizer, with_template=True), "seq_len": seq_len,
            "truncation": truncation}


def _size_ok(path: Path, nbytes: int) -> bool:
    return path.is_file() and path.stat().st_size == nbytes


def open_pairs(path: Path, key: dict) -> dict | None:
    """{meta, chosen, rejected, bounds, records} memory maps of a complete store for this key; None otherwise."""
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    if meta.get("key") != key:
        return None
    n, seq_len, dtype = meta["pairs"], meta["seq_len"], np.dtype(meta["dtype"])
    sizes = {"chosen.bin": n * seq_len * dtype.itemsize, "rejected.bin": n * seq_len * dtype.itemsize,
             "bounds.bin": n * 3 * 4, "records.bin": n * 8}
    if not all(_size_ok(path / name, size) for name, size in sizes.items()):
        return None
    return {"path": path, "meta": meta, "chosen": np.memmap(path / "chosen.bin", dtype, "r", shape=(n, seq_len)),
            "rejected": np.memmap(path / "rejected.bin", dtype, "r", shape=(n, seq_len)),
            "bounds": np.memmap(path / "bounds.bin", np.int32, "r", shape=(n, 3)),
            "records": np.memmap(path / "records.bin", np.int64, "r", shape=(n,))}


def record_where(spec: DataSpec, number: int) -> str:
    return f"dataset {spec.dataset!r}: record {number + 1} (counting from 1 over the dataset's files)"


def encoded_records(spec: DataSpec, tokenizer, records: list[dict], where) -> list[tuple]:
    """(prompt, chosen, rejected ids, mismatched) of each record (preference_records.encode_pairs); a malformed
    record raises UsageError naming it: where(offset) in words."""
    for offset, record in enumerate(records):
        if problem := pair_problem(record, spec.prompt_field):
            raise UsageError(f"{where(offset)} is not a valid preference record (train.objective "
                             f"{spec.objective!r}): {problem}: {str(record)[:160]}\n"
                             f"    fix: {pair_fix(spec.prompt_field)}")
    if lists := [offset for offset, record in enumerate(records) if isinstance(record["chosen"], list)]:
        check_pair_template(tokenizer, where(lists[0]))
    return encode_pairs(tokenizer, [split_pair(r, spec.prompt_field) for r in records])


def fitted_rows(encoded, numbers, seq_len: int, truncation: str, counts: dict,
                where) -> list[tuple[int, list[int], list[int], list[int]]]:
    """(record number, prompt, chosen, rejected ids) of the encoded records that fit seq_len (fit_pair); counts
    updated; a prompt that fills seq_len under truncate raises UsageError naming it: where(offset)."""
    out = []
    for offset, (number, (prompt, chosen, rejected, mismatched)) in enumerate(zip(numbers, encoded)):
        counts["records"] += 1
        counts["mismatched"] += bool(mismatched)
        for name, ids in (("chosen", chosen), ("rejected", rejected)):
            if not ids:
                raise empty_after_tokens(where(offset), name)
        fitted, what = fit_pair(list(prompt), list(chosen), list(rejected), seq_len, truncation)
        if what == "prompt" and truncation == "truncate":
            raise prompt_fills(where(offset), len(prompt), seq_len)
        if fitted is None:
            counts["dropped_" + what] += 1
            continue
        counts["truncated"] += what == "truncated"
        counts["identical"] += fitted[1] == fitted[2]
        out.append((number, *fitted))
    return out


def check_head(spec: DataSpec, tokenizer, seq_len: int, truncation: str) -> None:
    """Before any rank trains: the first records of each local file (builtin included) as pairs, so a malformed
    record, an empty completion, a prompt that fills seq_len (truncate) or a file whose pairs are all the same
    is refused (UsageError naming the file and line) before the process group exists. The store's build checks
    every record again (a problem past the head)."""
    from harness.data.files import head_records

    for path, wheres, records in head_records(spec):
        counts = dict.fromkeys(COUNTS, 0)
        where = lambda offset: f"data file {path} {wheres[offset]}"  # noqa: E731
        encoded = encoded_records(spec, tokenizer, records, where)
        rows = fitted_rows(encoded, range(len(records)), seq_len, truncation, counts, where)
        if rows and counts["identical"] == len(rows):
            raise UsageError(f"data file {path}: chosen and rejected are the same tokens in each of its first "
                             f"{len(rows)} pairs: there is no preference to learn\n    fix: {SAME_FIX}")


def _write_rows(files: dict, rows: list, seq_len: int, dtype: np.dtype, pad: int) -> None:
    n = len(rows)
    chosen, rejected = np.full((n, seq_len), pad, dtype), np.full((n, seq_len), pad, dtype)
    bounds, numbers = np.zeros((n, 3), np.int32), np.zeros(n, np.int64)
    for i, (number, prompt, chosen_ids, rejected_ids) in enumerate(rows):
        chosen[i, :len(prompt) + len(chosen_ids)] = prompt + chosen_ids
        rejected[i, :len(prompt) + len(rejected_ids)] = prompt + rejected_ids
        bounds[i] = (len(prompt), len(prompt) + len(chosen_ids), len(prompt) + len(rejected_ids))
        numbers[i] = number
    for name, array in (("chosen.bin", chosen), ("rejected.bin", rejected), ("bounds.bin", bounds),
                        ("records.bin", numbers)):
        array.tofile(files[name])


def _encoder(spec: DataSpec, tokenizer):
    """A batched, indexed `datasets.map` function: each record's ids (a picklable closure over the tokenizer)."""
    def encode(batch: dict, indices: list[int]) -> dict:
        names = list(batch)
        records = [dict(zip(names, values)) for values in zip(*batch.values())]
        encoded = encoded_records(spec, tokenizer, records, lambda offset: record_where(spec, indices[offset]))
        return {"prompt_ids": [e[0] for e in encoded], "chosen_ids": [e[1] for e in encoded],
                "rejected_ids": [e[2] for e in encoded], "mismatched": [e[3] for e in encoded], "number": indices}
    return encode


def _encoded(spec: DataSpec, tokenizer, tmp: Path, num_proc: int):
    """Every record encoded (over num_proc processes for a large set), read back BATCH_RECORDS at a time."""
    from harness.data.corpus import load_dataset_for
    from harness.data.files import check_local, load_failure

    check_local(spec)  # `harness data prepare` comes here without the launch's checks
    try:
        ds = load_dataset_for(spec, streaming=False)
    except UsageError:
        raise
    except Exception as err:  # datasets' builders fail on a malformed file in many ways
        raise load_failure(spec, err) or err from None
    num_proc = max(1, min(num_proc, len(ds) // MIN_PAIRS_PER_PROC))
    with _one_thread_per_process(num_proc):
        done = ds.map(_encoder(spec, tokenizer), batched=True, batch_size=BATCH_RECORDS, with_indices=True,
                      remove_columns=ds.column_names, num_proc=num_proc if num_proc > 1 else None,
                      cache_file_name=str(tmp / "encoded.arrow"), desc="tokenize pairs")
    for batch in done.iter(batch_size=BATCH_RECORDS):
        yield list(zip(batch["prompt_ids"], batch["chosen_ids"], batch["rejected_ids"], batch["mismatched"])), \
            batch["number"]


def _build(spec: DataSpec, tokenizer, key: dict, tmp: Path, num_proc: int) -> dict:
    """Tokenize every pair into tmp; returns its meta (not yet written)."""
    start = time.perf_counter()
    seq_len, dtype = key["seq_len"], dtype_for(len(tokenizer))
    counts = dict.fromkeys(COUNTS, 0)
    names = ("chosen.bin", "rejected.bin", "bounds.bin", "records.bin")
    with contextlib.ExitStack() as stack:
        files = {name: stack.enter_context(open(tmp / name, "wb")) for name in names}
        for encoded, numbers in _encoded(spec, tokenizer, tmp, num_proc):
            rows = fitted_rows(encoded, numbers, seq_len, key["truncation"], counts,
                               lambda offset: record_where(spec, numbers[offset]))
            _write_rows(files, rows, seq_len, dtype, tokenizer.pad_token_id)
            counts["pairs"] += len(rows)
    for leftover in tmp.glob("encoded*.arrow"):
        leftover.unlink()
    if counts["pairs"] == 0:
        raise UsageError(f"train.dataset {spec.dataset!r}: none of its {counts['records']} preference records fits "
                         f"train.seq_len={seq_len} ({counts['dropped_prompt']} prompts fill it, "
                         f"{counts['dropped_long']} pairs are longer; preference.truncation=drop)\n"
                         "    fix: raise train.seq_len, or set preference.truncation=truncate")
    if counts["identical"] == counts["pairs"]:
        raise UsageError(f"train.dataset {spec.dataset!r}: chosen and rejected are the same tokens in every one of "
                         f"its {counts['pairs']} pairs: there is no preference to learn\n    fix: {SAME_FIX}")
    return {"key": key, **key, **counts, "dtype": dtype.name, "vocab_size": len(tokenizer),
            "pad_id": tokenizer.pad_token_id, "prepared_s": round(time.perf_counter() - start, 3)}


def prepare_pairs(spec: DataSpec, tokenizer, seq_len: int, truncation: str, root: str | None = None,
                  num_proc: int | None = None) -> tuple[dict, bool]:
    """(opened store, prepared_now): the existing store for this key, else a new one built and published
    atomically (store.py's lock and rename)."""
    key = pairs_key(spec, tokenizer, seq_len, truncation)
    path = store_path(key, root)
    if (found := open_pairs(path, key)) is not None:
        return found, False
    path.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(path):
        if (found := open_pairs(path, key)) is not None:
            return found, False
        tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        tmp.mkdir()
        try:
            meta = _build(spec, tokenizer, key, tmp, num_proc or default_num_proc())
            (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
            _publish(tmp, path, key, opener=open_pairs)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    found = open_pairs(path, key)
    assert found is not None, f"preference store {path} unreadable right after it was written"
    return found, True


def _prepared_now(spec: DataSpec, tokenizer, seq_len: int, truncation: str, root: str | None) -> bool:
    return prepare_pairs(spec, tokenizer, seq_len, truncation, root)[1]


def ensure_pairs(spec: DataSpec, tokenizer, seq_len: int, truncation: str, root: str | None, local_rank: int,
                 poll_s: float = 0.1) -> tuple[dict, bool]:
    """At a launch, as store.ensure_store: local rank 0 prepares the store in a child process if it is missing,
    the node's other ranks wait for it on the file system."""
    key = pairs_key(spec, tokenizer, seq_len, truncation)
    path = store_path(key, root)
    made = False
    if local_rank == 0 and open_pairs(path, key) is None:
        made = run_in_child(_prepared_now, (spec, tokenizer, seq_len, truncation, root),
                            f"the preference store for {spec.dataset!r}")
    while (found := open_pairs(path, key)) is None:
        if local_rank == 0:
            raise AssertionError(f"preference store {path} unreadable right after it was written")
        time.sleep(poll_s)
    return found, made
