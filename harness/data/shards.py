"""A token store written in shards while the ranks train (train.streaming=true): its layout and its reader.

One folder per key (the finished store's key, store.store_key, plus the layout and the shard size), beside the
finished stores under train.store_dir:
    manifest.json      seq_len, shard_rows, dtype, "shards" (how many are published), "rows" (in them), "next"
                       ([record, skip]: where the next shard starts in the source), "done" and, once done, the counts
    shards/000000/     tokens.bin, loss_mask.bin (instruction/chat), doc_index.bin (uint64 ends of the documents
                       that end inside the shard, as offsets from its first token), meta.json
    writer.json        the writer's status (harness/data/stream_writer.py): pid, host, state, heartbeat, error
    writer.log         the writer's output
The corpus is one token stream cut into seq_len rows, exactly as a finished store cuts it; shard k holds rows
k*R .. k*R+R-1 of it (R = shard_rows). Every shard but the last holds R rows; the last is published with done and
holds the rest (the tail under seq_len dropped). A shard is written under a temporary name, renamed into place,
and only then counted in the manifest (itself replaced atomically): a reader trusts the manifest's count only.

A rank holds the manifest (a few numbers), at most OPEN_SHARDS memory maps and nothing per row of the corpus, so its
memory does not grow with the corpus.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from harness.config.stream_rules import shard_rows
from harness.data.corpus import DataSpec
from harness.data.rows import Rows, split_rows
from harness.data.store import store_key, store_path
from harness.errors import UsageError

LAYOUT = "shards-1"  # bump when the shard layout changes: old shard stores are not reused
OPEN_SHARDS = 4  # memory maps a rank keeps open (a step reads one or two shards)
POLL_S = 0.2
PROGRESS_S = 10.0  # a waiting rank's progress line, every this many seconds
STALE_S = 60.0  # a writer whose heartbeat is older than this (and that a rank waited for this long) is lost
FIRST_LINE_S = 0.5  # a wait shorter than this prints nothing
MANIFEST, STATUS, LOG = "manifest.json", "writer.json", "writer.log"


def stream_key(spec: DataSpec, tokenizer, seq_len: int, shard_tokens: int) -> dict:
    return {**store_key(spec, tokenizer, seq_len), "layout": LAYOUT,
            "shard_rows": shard_rows(shard_tokens, seq_len)}


def stream_path(key: dict, root: str | None) -> Path:
    return store_path(key, root)  # the key differs from the finished store's: another folder


def shard_dir(path: Path, k: int) -> Path:
    return path / "shards" / f"{k:06d}"


def write_json(path: Path, value: dict) -> None:
    """Replace path atomically (a reader sees the old or the new file, never a partial one)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value, indent=1) + "\n")
    os.replace(tmp, path)


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_manifest(path: Path, key: dict) -> dict | None:
    """The manifest if it was written for this key (None: none yet, or one of another key, which the writer
    replaces)."""
    manifest = read_json(path / MANIFEST)
    return manifest if manifest is not None and manifest.get("key") == key else None


@dataclass
class Shard:
    tokens: np.ndarray  # memmap [rows, seq_len]
    loss_mask: np.ndarray | None
    doc_ends: np.ndarray  # memmap uint64: ends of the documents ending inside the shard, from its first token


def open_shard(path: Path, k: int, rows: int, manifest: dict) -> Shard:
    folder, seq_len = shard_dir(path, k), manifest["seq_len"]
    dtype = np.dtype(manifest["dtype"])
    tokens = np.memmap(folder / "tokens.bin", dtype=dtype, mode="r", shape=(rows, seq_len))
    mask = (np.memmap(folder / "loss_mask.bin", dtype=np.uint8, mode="r", shape=(rows, seq_len))
            if manifest["has_loss_mask"] else None)
    size = (folder / "doc_index.bin").stat().st_size // 8
    ends = np.memmap(folder / "doc_index.bin", dtype=np.uint64, mode="r", shape=(size,)) if size else \
        np.zeros(0, dtype=np.uint64)
    return Shard(tokens, mask, ends)


class WriterLost(RuntimeError):
    """The writer stopped before the store was done (it failed, was killed, or went silent)."""


@dataclass
class ShardStore:
    """The reader of one shard store. `writer`: the writer's multiprocessing Process (local rank 0 holds it; None
    elsewhere);
    `talk`: this rank prints the waiting lines (rank 0)."""

    path: Path
    key: dict
    writer: object = None
    talk: bool = False
    manifest: dict = field(default_factory=dict)
    waited_s: float = 0.0
    _open: OrderedDict = field(default_factory=OrderedDict)
    _since: float = field(default_factory=time.time)

    @property
    def shard_rows(self) -> int:
        return self.key["shard_rows"]

    @property
    def seq_len(self) -> int:
        return self.key["seq_len"]

    @property
    def rows(self) -> int:
        return self.manifest.get("rows", 0)

    @property
    def done(self) -> bool:
        return bool(self.manifest.get("done"))

    @property
    def num_shards(self) -> int:
        return self.manifest.get("shards", 0)

    def refresh(self) -> None:
        self.manifest = read_manifest(self.path, self.key) or {}

    def shard_size(self, k: int) -> int:
        return min(self.shard_rows, self.rows - k * self.shard_rows)

    def shard(self, k: int) -> Shard:
        """Shard k's memory maps (it must be published); the OPEN_SHARDS most recent stay open."""
        if k in self._open:
            self._open.move_to_end(k)
            return self._open[k]
        if k >= self.num_shards:
            self.refresh()
        assert k < self.num_shards, f"shard {k} read before it was published ({self.num_shards})"
        self._open[k] = open_shard(self.path, k, self.shard_size(k), self.manifest)
        while len(self._open) > OPEN_SHARDS:
            self._open.popitem(last=False)
        return self._open[k]

    def wait(self, enough, what: str) -> None:
        """Until enough(self) (re-read the manifest every POLL_S) or the store is done; a progress line from
        FIRST_LINE_S on, then every PROGRESS_S; WriterLost (or the writer's UsageError) if the writer stops first."""
        self.refresh()
        if self.done or enough(self):
            return
        start, said = time.monotonic(), None
        while not (self.done or enough(self)):
            waited = time.monotonic() - start
            self.check_writer(waited)
            if self.talk and waited >= FIRST_LINE_S and (said is None or waited - said >= PROGRESS_S):
                say_wait(self, what, waited)
                said = waited
            time.sleep(POLL_S)
            self.refresh()
        self.waited_s += time.monotonic() - start

    def check_writer(self, waited: float) -> None:
        """Raise if the writer is gone before the store is done: its own failure report, its exit (local rank 0
        holds the process), or a heartbeat older than STALE_S after this rank waited that long."""
        status = read_json(self.path / STATUS) or {}
        if status.get("state") == "failed" and status.get("at", 0) >= self._since - 1:
            raise_failure(self, status)
        code = self.writer.exitcode if self.writer is not None else None
        if code is not None:
            self.refresh()
            if self.done:
                return
            if status.get("state") == "failed" and status.get("pid") == self.writer.pid:
                raise_failure(self, status)
            raise WriterLost(f"the stream writer of {self.path} exited with code {code} before the store was "
                             f"done ({self.num_shards} shards published){log_tail(self.path)}\n    fix: see "
                             f"{self.path / LOG}; a new launch continues from the published shards")
        beat = status.get("heartbeat", 0)
        if waited > STALE_S and time.time() - beat > STALE_S:
            raise WriterLost(f"no stream writer has reported on {self.path} for {time.time() - beat:.0f} s "
                             f"({status.get('host', 'no host')} pid {status.get('pid', '?')}), and this rank waited "
                             f"{waited:.0f} s for rows\n    fix: see {self.path / LOG}; a new launch continues "
                             "from the published shards")

    def first_split(self, eval_fraction: float, seed: int, packing: str) -> tuple[Rows, np.ndarray]:
        """(eval rows, shard 0's training rows): the eval split is eval_fraction of shard 0's rows (the whole
        corpus is not known at the first step), chosen as split_rows chooses it."""
        first = self.shard(0)
        size = self.shard_size(0)
        ends = first.doc_ends if packing == "document" else None
        try:
            train, held = split_rows(Rows(first.tokens, first.loss_mask, np.arange(size, dtype=np.int64), ends),
                                     eval_fraction, seed)
        except ValueError as err:
            raise UsageError(f"train.streaming: {err} (the eval split is taken from the first shard of "
                             f"{size} rows)\n    fix: a smaller train.eval_fraction or a larger "
                             "train.stream_shard_tokens") from None
        return held, train.index


def say_wait(store: ShardStore, what: str, waited: float) -> None:
    from harness.log import say

    status = read_json(store.path / STATUS) or {}
    say("data", f"{what} waits for the stream writer: {store.rows} rows in {store.num_shards} shards published, "
                f"{status.get('records', 0):,} records read ({status.get('state', 'starting')}), {waited:.0f} s")


def log_tail(path: Path, lines: int = 8) -> str:
    try:
        text = (path / LOG).read_text(errors="replace").strip().splitlines()[-lines:]
    except OSError:
        return ""
    return ("; its log ends:\n      " + "\n      ".join(text)) if text else ""


def raise_failure(store: ShardStore, status: dict) -> None:
    if status.get("kind") == "usage":  # a record the format cannot read, met in the stream: bad input
        raise UsageError(status["error"])
    raise WriterLost(f"the stream writer of {store.path} failed ({status.get('host')} pid {status.get('pid')}):\n"
                     f"{status.get('error', '')}\n    fix: see {store.path / LOG}; a new launch continues from "
                     "the published shards")


def host() -> str:
    return socket.gethostname()
