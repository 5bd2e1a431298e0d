"""The precomputed teacher: its top-k targets for every loss token of the data, written once beside the token store
and memory-mapped by every rank, so a teacher that does not fit beside the student still teaches.

One folder per key (the teacher's name and a fingerprint of its weights, the data's store key: dataset and its
fingerprint, tokenizer, seq_len; k, temperature, precision), named by its digest, inside the data's store folder:
    ids.bin        [tokens, k] the teacher's top-k ids, most likely first (uint16 when the vocabulary fits, else
                   uint32)
    logps.bin      [tokens, k] float32 their log-probs at the temperature
    actual.bin     [tokens] float32 the log-prob of the token actually there (the reverse KL's, beta > 0)
    row_index.bin  [rows + 1] uint64: row r's loss tokens are entries row_index[r]:row_index[r + 1], in
                   topk.loss_positions' order
    meta.json      the key, counts, bytes per token and the write time; written last
The tail mass is not stored: it is 1 - sum(exp(top-k log-probs)), derived from them at load as TRL derives it
from a server's answer, so the precomputed and the served teacher give the same bits.

Written by the teacher's forward pass one micro-batch per rank at a time: at step s the ranks take consecutive
blocks of `micro` rows (rank r the r-th), a rank with none left runs a filler forward (a ZeRO-3 teacher's
forward is collective) whose result is dropped, and each step's results are gathered to every node's first rank,
which appends them in row order into a temporary folder renamed into place when complete (harness/data/store.py's
_publish). A folder under its final name is whole; one whose meta or file sizes do not match is rebuilt, never
read. The store is read instead of written when every rank finds it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from harness.data.store import _publish, dtype_for
from harness.distill.topk import TopK, tokens_per_row

STORE_VERSION = 1  # bump when the layout or the meaning of a file changes: old stores are not read
LOGP_BYTES = 4  # float32


def store_key(*, teacher: str, weights, data: dict, k: int, temperature: float, precision: str) -> dict:
    """What the numbers depend on. `data`: the token store's key (its tokenizer_hash and seq_len are named again
    here so a reader of meta.json sees them)."""
    return {"version": STORE_VERSION, "teacher": teacher, "weights": weights, "data": data,
            "tokenizer_hash": data.get("tokenizer_hash"), "seq_len": data.get("seq_len"), "k": int(k),
            "temperature": float(temperature), "precision": precision}


def store_path(data_folder: Path, key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return Path(data_folder) / f"teacher_topk-k{key['k']}-{digest}"


def bytes_per_token(k: int, vocab_size: int) -> int:
    """Disk bytes of one loss token: k ids, k float32 log-probs, one float32 actual-token log-prob."""
    return k * (dtype_for(vocab_size).itemsize + LOGP_BYTES) + LOGP_BYTES


@dataclass
class TeacherStore:
    path: Path
    meta: dict
    ids: np.ndarray  # memmap [tokens, k]
    logps: np.ndarray  # memmap [tokens, k] float32
    actual: np.ndarray  # memmap [tokens] float32
    row_index: np.ndarray  # memmap [rows + 1] uint64

    def rows(self, row_ids) -> TopK:
        """The targets of these rows' loss tokens, rows in the order given."""
        spans = [(int(self.row_index[r]), int(self.row_index[r + 1])) for r in np.asarray(row_ids).tolist()]
        def pick(a, dtype):
            return torch.from_numpy(np.concatenate([a[s:e] for s, e in spans]) if spans else a[:0]).to(dtype)
        return TopK(pick(self.ids, torch.int64), pick(self.logps, torch.float32), pick(self.actual, torch.float32))


def _sizes_ok(path: Path, meta: dict) -> bool:
    tokens, k = meta["tokens"], meta["key"]["k"]
    want = {"ids.bin": tokens * k * np.dtype(meta["dtype"]).itemsize, "logps.bin": tokens * k * LOGP_BYTES,
            "actual.bin": tokens * LOGP_BYTES, "row_index.bin": (meta["rows"] + 1) * 8}
    return all((path / name).is_file() and (path / name).stat().st_size == size for name, size in want.items())


def open_teacher_store(path: Path, key: dict) -> TeacherStore | None:
    """The store at path if it is complete and was made for this key; None if missing, partial or stale."""
    try:
        meta = json.loads((Path(path) / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    if meta.get("key") != key or not _sizes_ok(Path(path), meta):
        return None
    tokens, k = meta["tokens"], key["k"]

    def mapped(name, dtype, shape):
        if not int(np.prod(shape)):  # np.memmap refuses an empty file
            return np.zeros(shape, dtype=dtype)
        return np.memmap(Path(path) / name, dtype=dtype, mode="r", shape=shape)
    return TeacherStore(path=Path(path), meta=meta, ids=mapped("ids.bin", np.dtype(meta["dtype"]), (tokens, k)),
                        logps=mapped("logps.bin", np.float32, (tokens, k)),
                        actual=mapped("actual.bin", np.float32, (tokens,)),
                        row_index=mapped("row_index.bin", np.uint64, (meta["rows"] + 1,)))


class _Appender:
    """The files of a store being written, appended to in row order."""

    def __init__(self, tmp: Path, dtype: np.dtype):
        self.dtype, self.tokens, self.rows = dtype, 0, 0
        self.files = {name: open(tmp / name, "wb") for name in ("ids.bin", "logps.bin", "actual.bin", "row_index.bin")}
        np.zeros(1, dtype=np.uint64).tofile(self.files["row_index.bin"])

    def add(self, ids: np.ndarray, logps: np.ndarray, actual: np.ndarray, counts: np.ndarray) -> None:
        if ids.size and int(ids.max()) > np.iinfo(self.dtype).max:
            raise AssertionError(f"token id {int(ids.max())} does not fit {self.dtype}")  # dtype_for's promise
        ids.astype(self.dtype).tofile(self.files["ids.bin"])
        logps.astype(np.float32).tofile(self.files["logps.bin"])
        actual.astype(np.float32).tofile(self.files["actual.bin"])
        (self.tokens + np.cumsum(counts, dtype=np.uint64)).tofile(self.files["row_index.bin"])
        self.tokens += int(counts.sum())
        self.rows += len(counts)

    def close(self) -> None:
        for f in self.files.values():
            f.flush()
            os.fsync(f.fileno())
            f.close()


def _world() -> tuple[int, int, bool]:
    """(rank, world, writes: this rank is its node's first)."""
    import torch.distributed as tdist

    if not (tdist.is_available() and tdist.is_initialized()):
        return 0, 1, True
    rank = tdist.get_rank()
    return rank, tdist.get_world_size(), int(os.environ.get("LOCAL_RANK", rank)) == 0


def _everyone(flag: bool, world: int) -> bool:
    if world == 1:
        return flag
    import torch.distributed as tdist

    found = [None] * world
    tdist.all_gather_object(found, bool(flag))
    return all(found)


def _my_rows(step: int, rank: int, world: int, micro: int, num_rows: int) -> np.ndarray:
    start = (step * world + rank) * micro
    return np.arange(start, min(start + micro, num_rows))


def _write(tmp: Path, key: dict, *, num_rows: int, batch, teacher, micro: int, vocab_size: int) -> dict:
    """Run the teacher over every row (this rank's share, gathered) into tmp on the writing ranks; the counts."""
    rank, world, writes = _world()
    appender = _Appender(tmp, dtype_for(vocab_size)) if writes else None
    started = time.perf_counter()
    for step in range(-(-num_rows // (world * micro))):
        rows = _my_rows(step, rank, world, micro, num_rows)
        input_ids, labels = batch(rows if rows.size else np.arange(1))  # a filler's result is dropped
        out = teacher(input_ids, labels) if rows.size or world > 1 else None
        mine = (*out.numpy(), tokens_per_row(labels).numpy()) if rows.size else None
        parts = [mine] * world
        if world > 1:
            import torch.distributed as tdist

            tdist.all_gather_object(parts, mine)
        for part in (p for p in parts if p is not None and appender is not None):
            appender.add(*part)
    if appender is None:
        return {}
    appender.close()
    return {"tokens": appender.tokens, "rows": appender.rows, "dtype": appender.dtype.name,
            "bytes_per_token": bytes_per_token(key["k"], vocab_size), "vocab_size": vocab_size,
            "write_s": round(time.perf_counter() - started, 3), "ranks": world}


def ensure_teacher_store(path: Path, key: dict, *, num_rows: int, batch, teacher, micro: int,
                         vocab_size: int) -> tuple[TeacherStore, bool]:
    """(store, written_now): the store at path when every rank finds it whole, else written once and published.
    batch(row_ids ndarray) -> (input_ids [b, L], labels [b, L]); teacher(input_ids, labels) -> TopK of those
    rows' loss tokens. Every rank calls this (with a process group: collectively)."""
    rank, world, writes = _world()
    found = open_teacher_store(path, key)
    if _everyone(found is not None, world):
        return found, False
    tmp = Path(path).with_name(f".tmp-{Path(path).name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    if writes:
        tmp.mkdir(parents=True)
    try:
        counts = _write(tmp, key, num_rows=num_rows, batch=batch, teacher=teacher, micro=micro,
                        vocab_size=vocab_size)
        if writes:
            assert counts["rows"] == num_rows, f"{counts['rows']} rows written of {num_rows}"
            (tmp / "meta.json").write_text(json.dumps({"key": key, **counts}, indent=2) + "\n")
            _publish(tmp, Path(path), key, opener=open_teacher_store)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if world > 1:
        import torch.distributed as tdist

        tdist.barrier()
    store = open_teacher_store(path, key)
    assert store is not None, f"teacher store {path} unreadable right after it was written"
    return store, True
