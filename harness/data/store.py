"""The prepared token store: a corpus tokenized once into flat files that every rank memory-maps.

One folder per (dataset source, tokenizer, seq_len, format and its fields), named by a hash of that key:
    tokens.bin      all documents' token ids back to back (each ends with eos), uint16 when the vocabulary
                    fits, else uint32; row r of the packed corpus is tokens[r * seq_len:(r + 1) * seq_len]
    loss_mask.bin   uint8 per token, 1 where the token is a training target (instruction/chat only)
    doc_index.bin   uint64 end offset of every document in tokens.bin (Megatron's .idx, minus the sizes)
    meta.json       the key, counts, dtype, and how it was made; written last
It is written into a temporary folder beside the final one and renamed into place, so a folder under its final
name is complete; one whose meta does not match the key or whose files have the wrong size is stale and is
rebuilt, never read. Packing (documents joined, cut into seq_len rows, the tail dropped) is a reshape of the
memory map, so a rank's private memory does not grow with the corpus: the page cache holds the tokens once.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from harness.errors import UsageError
from harness.data.corpus import DataSpec, source_fingerprint

STORE_VERSION = 1  # bump when the file layout or the tokenization rules change: old stores are not reused
DEFAULT_ROOT = "~/.cache/dsharness/stores"
CHUNK_DOCS = 50_000  # documents written per pass: bounds the writer's memory
MIN_DOCS_PER_PROC = 10_000


def tokenizer_hash(tokenizer, with_template: bool) -> str:
    """What the ids depend on: the tokenizer's full definition, its eos id (and chat template for chat)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        body = backend.to_str()
    else:
        from datasets.fingerprint import Hasher

        body = Hasher.hash(tokenizer)
    template = getattr(tokenizer, "chat_template", None) if with_template else None
    text = f"{type(tokenizer).__name__}|{tokenizer.eos_token_id}|{template}|{body}"
    return hashlib.sha256(text.encode()).hexdigest()


def store_key(spec: DataSpec, tokenizer, seq_len: int) -> dict:
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    return {"version": STORE_VERSION, "dataset": spec.dataset, "config": spec.config, "split": spec.split,
            "dataset_fingerprint": source_fingerprint(spec), "format": spec.format, "fields": spec.fields,
            "tokenizer_hash": tokenizer_hash(tokenizer, spec.uses_chat_template), "seq_len": seq_len,
            **({"chat_turns": spec.chat_turns} if spec.uses_chat_template else {})}


def store_path(key: dict, root: str | None) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in Path(key["dataset"]).name)[:40]
    return Path(root or DEFAULT_ROOT).expanduser() / f"{name}-{key['format']}-{key['seq_len']}-{digest}"


def dtype_for(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


@dataclass
class Store:
    path: Path
    meta: dict
    tokens: np.ndarray  # memmap [rows, seq_len]
    loss_mask: np.ndarray | None  # memmap [rows, seq_len] of 0/1, None when every token carries loss
    doc_ends: np.ndarray | None = None  # memmap [documents] uint64: end offset of each document (doc_index.bin)

    @property
    def num_rows(self) -> int:
        return self.meta["rows"]


def _file_ok(path: Path, count: int, itemsize: int) -> bool:
    return path.is_file() and path.stat().st_size == count * itemsize


def open_store(path: Path, key: dict) -> Store | None:
    """The store at path if it is complete and was made for this key; None if missing, partial or stale."""
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    if meta.get("key") != key:
        return None
    dtype = np.dtype(meta["dtype"])
    if not _file_ok(path / "tokens.bin", meta["tokens"], dtype.itemsize):
        return None
    if meta["has_loss_mask"] and not _file_ok(path / "loss_mask.bin", meta["tokens"], 1):
        return None
    if not _file_ok(path / "doc_index.bin", meta["documents"], 8):
        return None
    shape = (meta["rows"], meta["seq_len"])
    tokens = np.memmap(path / "tokens.bin", dtype=dtype, mode="r", shape=shape)
    mask = np.memmap(path / "loss_mask.bin", dtype=np.uint8, mode="r", shape=shape) if meta["has_loss_mask"] else None
    ends = np.memmap(path / "doc_index.bin", dtype=np.uint64, mode="r", shape=(meta["documents"],))
    return Store(path=path, meta=meta, tokens=tokens, loss_mask=mask, doc_ends=ends)


def _write(tmp: Path, chunks, dtype: np.dtype, masked: bool) -> dict:
    """Append every chunk (pyarrow table of input_ids[, loss_mask] lists) to the flat files, streaming: the
    writer holds one chunk at a time however large the corpus. Returns the counts."""
    import pyarrow.compute as pc

    counts = {"documents": 0, "tokens": 0, "loss_tokens": 0}
    limit = np.iinfo(dtype).max
    names = ["tokens.bin", "doc_index.bin"] + (["loss_mask.bin"] if masked else [])
    with contextlib.ExitStack() as stack:
        tok_f, index_f, *mask_f = (stack.enter_context(open(tmp / name, "wb")) for name in names)
        for table in chunks:
            lengths = pc.list_value_length(table["input_ids"]).fill_null(0).to_numpy()
            ids = pc.list_flatten(table["input_ids"]).to_numpy()
            if ids.size and int(ids.max()) > limit:
                raise AssertionError(f"token id {int(ids.max())} does not fit {dtype}")  # dtype_for's promise
            ids.astype(dtype).tofile(tok_f)
            if masked:
                mask = pc.list_flatten(table["loss_mask"]).to_numpy().astype(np.uint8)
                counts["loss_tokens"] += int(mask.sum())
                mask.tofile(mask_f[0])
            lengths = lengths[lengths > 0]
            (counts["tokens"] + np.cumsum(lengths, dtype=np.uint64)).tofile(index_f)
            counts["documents"] += len(lengths)
            counts["tokens"] += int(lengths.sum())
    if not masked:
        counts["loss_tokens"] = counts["tokens"]
    return counts


@contextlib.contextmanager
def _one_thread_per_process(num_proc: int):
    """With several worker processes, each tokenizes on one thread: a fast tokenizer's own thread pool (which a
    single process uses to fill the cores) would otherwise put num_proc x cores threads on the cores."""
    if num_proc <= 1:
        yield
        return
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # forked workers inherit it; the tokenizer reads it per call
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


def _rows_without_loss(path: Path, seq_len: int, rows: int) -> int:
    """Packed rows in which no token is a target (the first token of a row never is): they train nothing."""
    mask = np.memmap(path, dtype=np.uint8, mode="r", shape=(rows, seq_len))
    step = max(1, (64 << 20) // seq_len)  # 64 MB of mask at a time
    return int(sum((~mask[i:i + step, 1:].any(axis=1)).sum() for i in range(0, rows, step)))


def _mapped_chunks(ds, encode, features, num_proc: int, tmp: Path):
    """Tokenize with datasets.map over num_proc processes (its Arrow output lives in tmp), then read it back
    CHUNK_DOCS documents at a time."""
    with _one_thread_per_process(num_proc):
        tokenized = ds.map(encode, batched=True, batch_size=1000, remove_columns=ds.column_names,
                           with_indices=getattr(encode, "with_indices", False),  # records named in errors
                           features=features, num_proc=num_proc if num_proc > 1 else None,
                           cache_file_name=str(tmp / "tokenized.arrow"), desc="tokenize")
    yield from tokenized.with_format("arrow").iter(batch_size=CHUNK_DOCS)


_STREAM_ENCODE = None  # the encoder forked pool workers inherit (closures do not pickle)


def _encode_inherited(batch):
    return _STREAM_ENCODE(batch)


def _streamed_chunks(ds, encode, features, num_proc: int):
    """A streamed (IterableDataset) source: batches encoded by num_proc forked workers as they arrive, in order."""
    import multiprocessing

    import pyarrow as pa

    global _STREAM_ENCODE
    _STREAM_ENCODE = encode
    schema = features.arrow_schema
    batches = ds.iter(batch_size=CHUNK_DOCS // 10)
    with _one_thread_per_process(num_proc), multiprocessing.get_context("fork").Pool(max(1, num_proc)) as pool:
        for encoded in pool.imap(_encode_inherited, batches):
            yield pa.Table.from_pydict(encoded, schema=schema)


def _features(masked: bool):
    import datasets

    seq = getattr(datasets, "List", datasets.Sequence)
    cols = {"input_ids": seq(datasets.Value("int32"))}
    if masked:
        cols["loss_mask"] = seq(datasets.Value("uint8"))
    return datasets.Features(cols)


def default_num_proc() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _build(spec: DataSpec, tokenizer, key: dict, tmp: Path, num_proc: int, streaming: bool | None) -> dict:
    """Tokenize the corpus into tmp; returns its meta (not yet written)."""
    from harness.data.corpus import load_dataset_for
    from harness.data.files import check_local, load_failure
    from harness.data.formats import encoder

    start = time.perf_counter()
    encode = encoder(spec, tokenizer)  # fails on a missing chat template before the corpus is read
    check_local(spec)  # `harness data prepare` comes here without the launch's checks
    try:
        ds = load_dataset_for(spec, streaming)
    except UsageError:
        raise
    except Exception as err:  # datasets' builders fail on a malformed file in many ways
        raise load_failure(spec, err) or err from None
    masked = spec.format != "text"  # instruction, chat, alpaca, sharegpt
    features = _features(masked)
    streamed = not hasattr(ds, "__len__")
    if not streamed:  # forking for few documents costs more than it saves
        num_proc = max(1, min(num_proc, len(ds) // MIN_DOCS_PER_PROC))
    chunks = (_streamed_chunks(ds, encode, features, num_proc) if streamed
              else _mapped_chunks(ds, encode, features, num_proc, tmp))
    dtype = dtype_for(len(tokenizer))
    counts = _write(tmp, chunks, dtype, masked)
    for leftover in tmp.glob("tokenized*.arrow"):
        leftover.unlink()
    rows = counts["tokens"] // key["seq_len"]
    if rows == 0:
        raise UsageError(f"train.dataset {spec.dataset!r}: the dataset has {counts['tokens']} tokens, fewer than one "
                         f"block of seq_len={key['seq_len']}\n    fix: use more text or a smaller train.seq_len")
    counts["rows_without_loss"] = _rows_without_loss(tmp / "loss_mask.bin", key["seq_len"], rows) if masked else 0
    return {"key": key, **key, **counts, "rows": rows, "dtype": dtype.name, "has_loss_mask": masked,
            "vocab_size": len(tokenizer), "num_proc": num_proc, "streamed": streamed,
            "prepared_s": round(time.perf_counter() - start, 3), "spec": asdict(spec)}


def empty_rows_note(meta: dict) -> str | None:
    """What to tell the user when some packed rows carry no loss at all (instruction/chat data)."""
    empty = meta.get("rows_without_loss", 0)
    if not empty:
        return None
    return (f"{empty} of {meta['rows']} rows have no target token (their whole seq_len={meta['seq_len']} window is "
            f"prompt or system text): their micro-batches add loss 0 and no gradient\n    fix: raise train.seq_len "
            f"or shorten the prompts")


def _publish(tmp: Path, path: Path, key: dict, opener=None) -> None:
    """Rename the finished tmp folder to its final name. A valid store already there (another process finished
    first) is kept and ours dropped; a stale one is moved aside, then removed (readers keep their open maps).
    opener: what reads a complete one (open_store; the preference store's for pairs)."""
    stale = None
    if path.exists():
        if (opener or open_store)(path, key) is not None:
            return
        stale = path.with_name(f".stale-{path.name}-{uuid.uuid4().hex[:8]}")
        os.replace(path, stale)
    try:
        os.replace(tmp, path)
    except OSError:  # published by another process between the check and here: keep theirs
        pass
    if stale is not None:
        shutil.rmtree(stale, ignore_errors=True)


@contextlib.contextmanager
def _exclusive(path: Path):
    """One preparer per store at a time across processes (and nodes sharing the folder, where flock works):
    the others wait here, then find the store made."""
    import fcntl

    with open(path.with_name(f".lock-{path.name}"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def prepare(spec: DataSpec, tokenizer, seq_len: int, root: str | None = None, num_proc: int | None = None,
            streaming: bool | None = None) -> tuple[Store, bool]:
    """(store, prepared_now): the existing store for this key, else a new one built atomically."""
    key = store_key(spec, tokenizer, seq_len)
    path = store_path(key, root)
    found = open_store(path, key)
    if found is not None:
        return found, False
    path.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(path):
        found = open_store(path, key)
        if found is not None:
            return found, False
        tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        tmp.mkdir()
        try:
            meta = _build(spec, tokenizer, key, tmp, num_proc or default_num_proc(), streaming)
            (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
            _publish(tmp, path, key)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    store = open_store(path, key)
    assert store is not None, f"store {path} unreadable right after it was written"
    return store, True


def _child_body(conn, target, args: tuple) -> None:
    """The body of run_in_child's process: the outcome goes back through conn, never as a traceback."""
    import traceback

    try:
        conn.send(("ok", target(*args)))
    except UsageError as e:
        conn.send(("usage", str(e)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def run_in_child(target, args: tuple, what: str):
    """target(*args) in a fresh process; its (picklable) result. Tokenizing grows the process by what `datasets`,
    Arrow and the tokenizer allocate (malloc arenas and Arrow's pool keep it afterwards: +110 MB per rank at 40M
    tokens), which a training rank would carry for the whole run; a child gives all of it back when it exits.
    Spawned, not forked: the rank already runs the process group's threads. A UsageError comes back as one."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child_body, args=(child, target, args), name="dsharness-prepare")
    proc.start()
    child.close()
    try:
        kind, value = parent.recv()
    except EOFError:  # it died without a word (killed, out of memory)
        proc.join()
        raise RuntimeError(f"preparing {what}: the preparing process exited {proc.exitcode} without a "
                           "result") from None
    proc.join()
    if kind == "usage":
        raise UsageError(value)
    if kind == "error":
        raise RuntimeError(f"preparing {what} failed in its process:\n{value}")
    return value


def _prepared_now(spec: DataSpec, tokenizer, seq_len: int, root: str | None) -> bool:
    return prepare(spec, tokenizer, seq_len, root)[1]


def prepare_in_child(spec: DataSpec, tokenizer, seq_len: int, root: str | None) -> bool:
    """prepare() in a fresh process (run_in_child); whether it built the store."""
    return run_in_child(_prepared_now, (spec, tokenizer, seq_len, root), f"the token store for {spec.dataset!r}")


def ensure_store(spec: DataSpec, tokenizer, seq_len: int, root: str | None, local_rank: int,
                 poll_s: float = 0.1) -> tuple[Store, bool]:
    """At a launch: local rank 0 prepares the store if it is missing (all cores, in a child process: a training
    rank's memory is the same whether or not the store existed); the node's other ranks wait for it on the file
    system rather than in a collective, which would time out on a long preparation (if rank 0 fails, the
    launcher ends them)."""
    key = store_key(spec, tokenizer, seq_len)
    path = store_path(key, root)
    made = False
    if local_rank == 0 and open_store(path, key) is None:
        made = prepare_in_child(spec, tokenizer, seq_len, root)
    while (store := open_store(path, key)) is None:
        if local_rank == 0:
            raise AssertionError(f"store {path} unreadable right after it was written")  # prepare()'s promise
        time.sleep(poll_s)
    return store, made
