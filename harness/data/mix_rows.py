"""A mixture's rows as the trainer sees them: several sources' Rows behind one row id space, and the batch plan
that reads them by the blend (harness/data/blend.py).

Row id r of a mixture is row r - offsets[s] of source s's split (offsets: the sources' split sizes, summed), so a
selection of ids is a view like Rows', and the trainer fetches, logs faults and evaluates it the same way.
MixPlan has BatchPlan's interface: data batch b reads blend positions [b * G, (b + 1) * G), in rank order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from harness.data.batches import check_shape
from harness.data.blend import Blend, epoch_order


class MixRows:
    def __init__(self, parts: list, names: list[str], index: np.ndarray | None = None):
        """parts: each source's Rows (one split); index: the mixture row ids of this view (None: all)."""
        self.parts, self.names = parts, names
        self.offsets = np.cumsum([0] + [len(p) for p in parts]).astype(np.int64)
        self.index = np.arange(self.offsets[-1], dtype=np.int64) if index is None else np.asarray(index, np.int64)
        self.doc_ends = parts[0].doc_ends if parts else None  # for faults.rows_named: which packing

    @property
    def sizes(self) -> list[int]:
        return [len(p) for p in self.parts]

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self.index), self.parts[0].shape[1])

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, sel) -> "MixRows":
        if torch.is_tensor(sel):
            sel = sel.numpy()
        return MixRows(self.parts, self.names, self.index[sel])

    def source_ids(self) -> np.ndarray:
        """The source of each row of this view."""
        return np.searchsorted(self.offsets, self.index, side="right") - 1

    def source(self, s: int) -> "MixRows":
        """This view's rows of source s."""
        return self[np.flatnonzero(self.source_ids() == s)]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Each source's rows read from its own store, put back in this view's order."""
        ids = self.source_ids()
        out = None
        for s in np.unique(ids):
            where = np.flatnonzero(ids == s)
            got = self.parts[s][self.index[where] - self.offsets[s]].tensors()
            if out is None:
                out = [torch.empty((len(self.index), *t.shape[1:]), dtype=t.dtype) for t in got]
            for o, t in zip(out, got):
                o[torch.from_numpy(where)] = t
        return tuple(out)


@dataclass(frozen=True)
class MixPlan:
    """BatchPlan's interface over a mixture: sizes[s] rows in source s's training split, read by `blend`."""

    sizes: tuple[int, ...]
    blend: Blend
    global_batch: int
    micro_batch: int
    grad_accum: int
    dp_rank: int = 0
    dp_size: int = 1
    seed: int = 0

    def __post_init__(self):
        check_shape(self)

    @property
    def offsets(self) -> np.ndarray:
        return np.cumsum((0,) + self.sizes).astype(np.int64)

    @property
    def steps_per_epoch(self) -> int:
        """Steps to one epoch of the source that runs out first at its weight (at least 1)."""
        weights = np.asarray(self.blend.segments[-1].weights, dtype=np.float64)
        shares = weights / weights.sum()
        return max(1, int(np.ceil(min(np.asarray(self.sizes) / shares) / self.global_batch)))

    def counts(self, step: int) -> np.ndarray:
        """[S] rows of each source read by the data batches before `step`."""
        return self.blend.counts(step * self.global_batch)

    def epochs(self, step: int) -> np.ndarray:
        """[S] epochs each source has given after `step` data batches (fractions)."""
        return self.counts(step) / np.asarray(self.sizes, dtype=np.float64)

    def epoch_of(self, step: int) -> int:
        """The epoch of the source furthest into its data at data batch `step` (0-based)."""
        return int(max((c - 1) // n for c, n in zip(self.counts(step + 1), self.sizes)))

    def global_rows(self, step: int) -> torch.Tensor:
        """The global_batch mixture row ids of data batch `step`, over all ranks, in rank order."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        ids, ks = self.blend.picks(step * self.global_batch, (step + 1) * self.global_batch)
        out = np.empty(len(ids), dtype=np.int64)
        offsets = self.offsets
        for s in np.unique(ids):
            where = np.flatnonzero(ids == s)
            n = self.sizes[s]
            k = ks[where]
            for epoch in np.unique(k // n):
                sel = where[k // n == epoch]
                out[sel] = offsets[s] + epoch_order(n, self.seed, int(s), int(epoch))[ks[sel] % n]
        return torch.from_numpy(out)

    def micro_batches(self, step: int) -> list:
        per_rank = self.micro_batch * self.grad_accum
        mine = self.global_rows(step)[self.dp_rank * per_rank:(self.dp_rank + 1) * per_rank]
        return list(mine.split(self.micro_batch))
