"""The training split of a shard store (train.streaming=true) and the rows each rank trains on at each step.

The order. A finished store's order (batches.BatchPlan: one randperm over all rows per epoch) needs the number of
rows, which a stream does not know until its writer is done. A streamed run therefore reads in the order a shard
store defines, which needs only the shards already published:
  - the eval split is eval_fraction of shard 0's rows (split_rows over that shard);
  - the training rows are shard 0's other rows, then every row of shard 1, 2, ... in store order;
  - epoch e visits them shard by shard, each shard's rows shuffled by a permutation seeded by (seed, e, shard);
  - a step takes the next global_batch positions of the epoch; the epoch's tail under a global batch is dropped
    (as BatchPlan drops it), so the steps per epoch (and every epoch after the first) are known once the writer
    is done; a step of epoch 0 needs only its rows published.
The rows a step reads are a pure function of the step, the seed, the batch and the shard size: a store being
written and the same store finished give the same rows step for step, and a resume needs nothing but the step
(on any number of data-parallel ranks: each takes its slice of the global batch, as BatchPlan does). A rank
that reaches rows not yet published waits for them (shards.ShardStore.wait).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from harness.data.batches import check_shape
from harness.data.rows import Rows
from harness.data.shards import ShardStore
from harness.errors import UsageError


@lru_cache(maxsize=8)
def _shuffle(seed: int, epoch: int, shard: int, size: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch, shard]).permutation(size)


class StreamRows:
    """The training rows of a shard store, addressed by store row (shard * shard_rows + row in the shard)."""

    def __init__(self, store: ShardStore, first_train: np.ndarray, packing: str):
        self.store, self.first_train, self.packing = store, first_train, packing

    @property
    def known_rows(self) -> int:
        """Training rows in the published shards (all of them once the writer is done)."""
        rows = self.store.rows
        return 0 if rows == 0 else len(self.first_train) + max(0, rows - self.store.shard_size(0))

    @property
    def shape(self) -> tuple[int, int]:
        return (self.known_rows, self.store.seq_len)

    def __len__(self) -> int:
        return self.known_rows

    def row_ids(self, positions: np.ndarray, epoch: int | None, seed: int = 0) -> np.ndarray:
        """Store rows at training positions (epoch None: store order, else epoch's shuffled order)."""
        size, first = self.store.shard_rows, len(self.first_train)
        positions = np.asarray(positions, dtype=np.int64)
        shard = np.where(positions < first, 0, 1 + (positions - first) // size)
        local = np.where(positions < first, positions, (positions - first) % size)
        out = np.empty_like(positions)
        for k in np.unique(shard):
            k = int(k)
            here = shard == k
            count = first if k == 0 else self.store.shard_size(k)
            picked = local[here] if epoch is None else _shuffle(seed, epoch, k, count)[local[here]]
            out[here] = k * size + (self.first_train[picked] if k == 0 else picked)
        return out

    def __getitem__(self, sel) -> "StreamView":
        """Store rows (a tensor or array, what StreamPlan gives) or a slice of training positions in store order."""
        if isinstance(sel, slice):
            return StreamView(self, self.row_ids(np.arange(self.known_rows)[sel], None))
        return StreamView(self, np.asarray(sel.numpy() if torch.is_tensor(sel) else sel, dtype=np.int64))

    def close(self) -> None:
        """The run is over: stop this node's writer (local rank 0; a new launch continues from its shards)."""
        from harness.data.stream_writer import stop

        if self.store.writer is not None and stop(self.store.writer) and self.store.talk:
            from harness.log import say

            self.store.refresh()
            say("data", f"stream writer stopped at {self.store.num_shards} shards ({self.store.rows} rows); the next "
                        f"launch continues from them (this rank waited {self.store.waited_s:.1f} s for rows)")


class StreamView:
    """Some store rows of a StreamRows; `tensors()` reads them from their shards (Rows.tensors per shard)."""

    def __init__(self, rows: StreamRows, index: np.ndarray):
        self.rows, self.index = rows, index
        self.doc_ends = None  # faults.rows_named names the store rows only

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self.index), self.rows.store.seq_len)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        store, size = self.rows.store, self.rows.store.shard_rows
        parts, order = [], []
        for k in np.unique(self.index // size):
            at = np.flatnonzero(self.index // size == k)
            shard = store.shard(int(k))
            ends = shard.doc_ends if self.rows.packing == "document" else None
            parts.append(Rows(shard.tokens, shard.loss_mask, self.index[at] - int(k) * size, ends).tensors())
            order.append(at)
        back = torch.from_numpy(np.argsort(np.concatenate(order), kind="stable"))
        return tuple(torch.cat(pieces)[back] for pieces in zip(*parts))


@dataclass
class StreamPlan:
    """batches.BatchPlan's interface over a StreamRows: global_rows, micro_batches, epoch_of."""

    train: StreamRows
    global_batch: int
    micro_batch: int
    grad_accum: int
    dp_rank: int = 0
    dp_size: int = 1
    seed: int = 0

    def __post_init__(self):
        check_shape(self)

    @property
    def steps_per_epoch(self) -> int | None:
        """None until the writer is done."""
        if not self.train.store.done:
            return None
        steps = self.train.known_rows // self.global_batch
        if steps == 0:
            raise UsageError(f"train.streaming: the whole corpus gives {self.train.known_rows} training rows, fewer "
                             f"than one global batch of {self.global_batch}\n    fix: more text, a smaller batch "
                             "or a shorter train.seq_len")
        return steps

    def epoch_of(self, step: int) -> int:
        spe = self.steps_per_epoch
        return 0 if spe is None else step // spe  # before done, only epoch 0's steps can have been read

    def global_rows(self, step: int) -> torch.Tensor:
        need = (step + 1) * self.global_batch
        if self.train.known_rows < need:
            self.train.store.wait(lambda _: self.train.known_rows >= need, f"step {step + 1}")
        spe = self.steps_per_epoch
        epoch = 0 if spe is None else step // spe
        start = (step if spe is None else step % spe) * self.global_batch
        positions = np.arange(start, start + self.global_batch, dtype=np.int64)
        return torch.from_numpy(self.train.row_ids(positions, epoch, self.seed))

    def micro_batches(self, step: int) -> list:
        per_rank = self.micro_batch * self.grad_accum
        mine = self.global_rows(step)[self.dp_rank * per_rank:(self.dp_rank + 1) * per_rank]
        return list(mine.split(self.micro_batch))


def load_stream(spec, tokenizer, train: dict, local_rank: int, talk: bool, global_batch: int):
    """(train StreamRows, eval Rows, store): local rank 0 starts this node's writer unless the store is done; every
    rank waits for the first shard and for one global batch of training rows (or the writer's end)."""
    from harness.data.shards import stream_key, stream_path, read_manifest
    from harness.data.stream_writer import spawn, stop

    key = stream_key(spec, tokenizer, train["seq_len"], train["stream_shard_tokens"])
    path = stream_path(key, train["store_dir"] or None)
    manifest = read_manifest(path, key)
    writer = None
    if local_rank == 0 and not (manifest and manifest["done"]):
        writer = spawn(spec, tokenizer, key, path)
    store = ShardStore(path, key, writer=writer, talk=talk)
    try:
        store.wait(lambda s: s.num_shards >= 1, "the first shard")
        held, first_train = store.first_split(train["eval_fraction"], train["seed"], train["packing"])
        rows = StreamRows(store, first_train, train["packing"])
        if rows.known_rows < global_batch:
            store.wait(lambda _: rows.known_rows >= global_batch, "the first step")
    except BaseException:
        if writer is not None:
            stop(writer)
        raise
    return rows, held, store
