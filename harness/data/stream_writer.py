"""The writer of a shard store (harness/data/shards.py): reads the source as a stream, tokenizes it and publishes
one shard of shard_rows packed rows at a time, while the ranks train on the shards already there.

Local rank 0 of each node starts it as a process of its own (spawned, in its own session: its pool workers go
with it) and stops it when the run ends; `harness data prepare --set
train.streaming=true` runs it to the end in the foreground. One writer per store at a time: it holds the store's
`.writer.lock` (flock); a second one (another run, another node on a shared folder) waits on it as a standby and
continues if the first one dies. A writer continues where the published shards end: the manifest's `next` is the
source record where the next shard starts and how many of its tokens the shards already hold, so a restarted writer
re-reads (without tokenizing) the records before it and publishes the same shards an uninterrupted one would.
It exits when its parent (the rank) is gone.

DSHARNESS_STREAM_PAUSE_S (seconds after each published shard) simulates a slower tokenizer for tests and bench/.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

import numpy as np

from harness.data.shards import LOG, MANIFEST, STATUS, host, read_json, read_manifest, shard_dir, write_json
from harness.data.store import _one_thread_per_process, dtype_for
from harness.errors import UsageError

BATCH_RECORDS = 1000  # records tokenized per call
HEARTBEAT_S = 2.0
PAUSE_ENV = "DSHARNESS_STREAM_PAUSE_S"


class Status:
    """writer.json: what this writer is doing, rewritten every HEARTBEAT_S by a thread (and at each change)."""

    def __init__(self, path: Path):
        self.path, self.state, self.extra, self.records = path, "running", {}, 0
        self.lock, self.stop = threading.Lock(), threading.Event()
        self.write()
        threading.Thread(target=self._beat, daemon=True, name="heartbeat").start()

    def write(self) -> None:
        with self.lock:
            write_json(self.path / STATUS, {"pid": os.getpid(), "host": host(), "state": self.state,
                                            "heartbeat": time.time(), "at": time.time(), "records": self.records,
                                            **self.extra})

    def _beat(self) -> None:
        while not self.stop.wait(HEARTBEAT_S):
            self.write()

    def end(self, state: str, **extra) -> None:
        self.stop.set()
        self.state, self.extra = state, extra
        self.write()


def _fresh(path: Path, key: dict, dtype: np.dtype, masked: bool) -> dict:
    shutil.rmtree(path / "shards", ignore_errors=True)
    manifest = {"key": key, "seq_len": key["seq_len"], "shard_rows": key["shard_rows"], "dtype": dtype.name,
                "has_loss_mask": masked, "shards": 0, "rows": 0, "next": [0, 0], "done": False}
    write_json(path / MANIFEST, manifest)
    return manifest


def _tidy(path: Path, published: int) -> None:
    """Remove what an interrupted writer left: temporary shards and shards renamed but never counted."""
    folder = path / "shards"
    folder.mkdir(exist_ok=True)
    for child in folder.iterdir():
        if child.name.startswith(".") or (child.name.isdigit() and int(child.name) >= published):
            shutil.rmtree(child, ignore_errors=True)


def _records(spec, start: int):
    """Batches of source records from record `start` on (the records before it are read, not tokenized)."""
    from harness.data.corpus import load_dataset_for
    from harness.data.files import load_failure

    try:
        ds = load_dataset_for(spec, streaming=True)
    except UsageError:
        raise
    except Exception as err:  # datasets' builders fail on a malformed file in many ways
        raise load_failure(spec, err) or err from None
    if start:
        ds = ds.skip(start)
    try:
        yield from ds.iter(batch_size=BATCH_RECORDS)
    except UsageError:
        raise
    except Exception as err:  # a streamed file fails where its bad line is read
        raise load_failure(spec, err) or err from None


_ENCODE = None  # the encoder forked pool workers inherit (closures do not pickle)


def _flat(encode, batch: dict, indices: list[int] | None):
    """(tokens per record, all token ids, all loss-mask bits or None) of a batch: numpy, cheap to send back."""
    out = encode(batch, indices) if indices is not None else encode(batch)
    ids, mask = out["input_ids"], out.get("loss_mask")
    lengths = np.array([len(x) for x in ids], dtype=np.int64)
    flat = np.fromiter((t for x in ids for t in x), dtype=np.int64, count=int(lengths.sum()))
    bits = None if mask is None else np.fromiter((t for x in mask for t in x), dtype=np.uint8, count=flat.size)
    return lengths, flat, bits


def _flat_inherited(job):
    return _flat(_ENCODE, *job)


def writer_procs() -> int:
    """Tokenizing processes of a writer: the node's cores the ranks leave (LOCAL_WORLD_SIZE), at least one."""
    from harness.data.store import default_num_proc

    return max(1, default_num_proc() - int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def _encoded(spec, tokenizer, start: int, num_proc: int):
    """_flat per batch of source records from record `start` on, in order; num_proc > 1: by forked workers."""
    import multiprocessing

    from harness.data.formats import encoder

    global _ENCODE
    encode = _ENCODE = encoder(spec, tokenizer)
    indexed = getattr(encode, "with_indices", False)

    def jobs():
        at = start
        for batch in _records(spec, start):
            size = len(next(iter(batch.values()))) if batch else 0
            yield batch, (list(range(at, at + size)) if indexed else None)
            at += size
    if num_proc <= 1:
        yield from (_flat(encode, *job) for job in jobs())
        return
    # one tokenizer thread per worker: a fast tokenizer's thread pool, used before the fork, deadlocks in the child
    with _one_thread_per_process(num_proc), multiprocessing.get_context("fork").Pool(num_proc) as pool:
        yield from pool.imap(_flat_inherited, jobs())


class Packer:
    """Cuts the token stream into shards of shard_rows x seq_len tokens. Holds at most one shard and one batch."""

    def __init__(self, path: Path, manifest: dict, status: Status, pause_s: float):
        self.path, self.manifest, self.status, self.pause_s = path, manifest, status, pause_s
        self.seq_len, self.shard_rows = manifest["seq_len"], manifest["shard_rows"]
        self.dtype, self.masked = np.dtype(manifest["dtype"]), manifest["has_loss_mask"]
        self.record, skip = manifest["next"]
        self.base = manifest["shards"] * self.shard_rows * self.seq_len  # stream offset of the first pending token
        self.ids = np.zeros(0, self.dtype)
        self.mask = np.zeros(0, np.uint8)
        self.ends = np.zeros(0, np.uint64)  # stream offsets of document ends not yet in a shard
        self.recs = np.zeros((0, 3), np.int64)  # pending records: (record, start offset, length)
        self.skip, self.cursor = skip, self.base - skip  # stream offset of the next record's first token

    def add(self, lengths: np.ndarray, flat: np.ndarray, bits: np.ndarray | None) -> None:
        """One batch of records: tokens per record, their ids back to back and loss-mask bits (_flat)."""
        starts = self.cursor + np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        if flat.size and int(flat.max()) > np.iinfo(self.dtype).max:
            raise AssertionError(f"token id {int(flat.max())} does not fit {self.dtype}")  # dtype_for's promise
        drop, self.skip = self.skip, 0  # a restart: the first record's first tokens are in the published shards
        self.ids = np.concatenate([self.ids, flat[drop:].astype(self.dtype)])
        if self.masked:
            self.mask = np.concatenate([self.mask, bits[drop:]])
        keep = lengths > 0
        self.ends = np.concatenate([self.ends, (starts + lengths)[keep].astype(np.uint64)])
        numbers = np.arange(self.record, self.record + len(lengths), dtype=np.int64)
        self.recs = np.concatenate([self.recs, np.stack([numbers, starts, lengths], axis=1)[keep]])
        self.record += len(lengths)
        self.cursor += int(lengths.sum())
        self.status.records = self.record
        while self.ids.size >= self.shard_rows * self.seq_len:
            self.publish(self.shard_rows, done=False)

    def publish(self, rows: int, done: bool) -> None:
        """Write the next shard of `rows` rows from the pending tokens, rename it into place, then count it."""
        k, n = self.manifest["shards"], rows * self.seq_len
        end = self.base + n
        tmp = self.path / "shards" / f".tmp-{k:06d}-{os.getpid()}"
        tmp.mkdir()
        self.ids[:n].tofile(tmp / "tokens.bin")
        inside = self.ends[(self.ends > self.base) & (self.ends <= end)]
        (inside - np.uint64(self.base)).tofile(tmp / "doc_index.bin")
        meta = {"rows": rows, "start": self.base, "documents_ending": int(inside.size)}
        if self.masked:
            self.mask[:n].tofile(tmp / "loss_mask.bin")
            grid = self.mask[:n].reshape(rows, self.seq_len)
            meta.update(loss_tokens=int(grid.sum()), rows_without_loss=int((~grid[:, 1:].any(axis=1)).sum()))
        write_json(tmp / "meta.json", meta)
        os.replace(tmp, shard_dir(self.path, k))
        self.ids, self.mask = self.ids[n:], self.mask[n:] if self.masked else self.mask
        self.ends, self.base = self.ends[self.ends > end], end
        self.recs = self.recs[self.recs[:, 1] + self.recs[:, 2] > end]
        after = [int(self.recs[0, 0]), end - int(self.recs[0, 1])] if len(self.recs) else [self.record, 0]
        self.manifest.update(shards=k + 1, rows=self.manifest["rows"] + rows, next=after)
        if not done:
            write_json(self.path / MANIFEST, self.manifest)
        if self.pause_s:
            time.sleep(self.pause_s)

    def finish(self, spec) -> None:
        rows = self.ids.size // self.seq_len
        if rows:
            self.publish(rows, done=True)
        if self.manifest["rows"] == 0:
            raise UsageError(f"train.dataset {spec.dataset!r}: the dataset has {self.ids.size} tokens, fewer than "
                             f"one block of seq_len={self.seq_len}\n    fix: use more text or a smaller train.seq_len")
        metas = [read_json(shard_dir(self.path, k) / "meta.json") for k in range(self.manifest["shards"])]
        self.manifest.update(done=True, records=self.record, tokens=self.manifest["rows"] * self.seq_len,
                             tail_tokens=int(self.ids.size) - rows * self.seq_len,
                             documents=sum(m["documents_ending"] for m in metas),
                             loss_tokens=sum(m.get("loss_tokens", m["rows"] * self.seq_len) for m in metas),
                             rows_without_loss=sum(m.get("rows_without_loss", 0) for m in metas))
        write_json(self.path / MANIFEST, self.manifest)


def write_store(spec, tokenizer, key: dict, path: Path, num_proc: int | None = None) -> dict:
    """Publish shards until the source ends, continuing from the published ones; the final manifest. Holds the
    store's writer lock (a second writer waits here). num_proc: tokenizing processes (None: writer_procs())."""
    import fcntl

    path.mkdir(parents=True, exist_ok=True)
    with open(path / ".writer.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        masked = spec.format != "text"
        manifest = read_manifest(path, key) or _fresh(path, key, dtype_for(len(tokenizer)), masked)
        if manifest["done"]:
            return manifest
        _tidy(path, manifest["shards"])
        status = Status(path)
        try:
            packer = Packer(path, manifest, status, float(os.environ.get(PAUSE_ENV, "0") or 0))
            print(f"[stream] {path}: {'continuing after ' if manifest['shards'] else 'starting at '}shard "
                  f"{manifest['shards']} (source record {manifest['next'][0]})", flush=True)
            for lengths, flat, bits in _encoded(spec, tokenizer, packer.record, num_proc or writer_procs()):
                packer.add(lengths, flat, bits)
            packer.finish(spec)
        except UsageError as err:
            status.end("failed", kind="usage", error=str(err))
            raise
        except SystemExit:  # stopped (SIGTERM) by the run that started it: the next launch continues
            status.end("stopped", shards=manifest["shards"])
            raise
        except BaseException:
            status.end("failed", kind="error", error=traceback.format_exc()[-4000:])
            raise
        status.end("done", shards=manifest["shards"])
        print(f"[stream] {path}: done, {manifest['shards']} shards, {manifest['rows']} rows", flush=True)
        return manifest


def _watch_parent(parent: int) -> None:
    """End this writer and its workers (its own process group) when the rank that started it is gone."""
    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def _child(spec, tokenizer, key: dict, path: str, parent: int) -> None:
    """The writer process's body: its own session (stop() ends it and its workers as one group), its output to
    writer.log, gone with its parent; exit 2 on bad input (the status says why), 1 on any other failure."""
    os.setsid()
    log = os.open(Path(path) / LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    _watch_parent(parent)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds: the status says stopped, the lock is freed
    try:
        write_store(spec, tokenizer, key, Path(path))
    except UsageError as err:
        print(f"[stream] error: {err}", flush=True)
        sys.exit(2)


def spawn(spec, tokenizer, key: dict, path: Path):
    """Start the writer of the store at `path` (local rank 0): a spawned process (the rank runs the process group's
    threads, so no fork), given the spec and the tokenizer as run_in_child gives its arguments."""
    import multiprocessing

    path.mkdir(parents=True, exist_ok=True)
    proc = multiprocessing.get_context("spawn").Process(target=_child, name="dsharness-stream-writer",
                                                        args=(spec, tokenizer, key, str(path), os.getpid()))
    proc.start()
    return proc


def stop(proc, timeout_s: float = 10.0) -> bool:
    """End the writer (a multiprocessing Process) and its workers if it still runs; whether it had to be stopped."""
    if proc.exitcode is not None:
        return False
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:  # not yet in its own group
        proc.terminate()
    proc.join(timeout_s)
    if proc.exitcode is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.kill()
        proc.join()
    return True


