"""Rows of a token store as the trainer sees them: a view (an index array) over the memory map.

`split[rows]` (a slice, or a LongTensor / array of positions) is another view, no data copied;
`split.tensors()` reads just those rows: (input_ids, labels) LongTensors [n, seq_len], labels -100 where the
token carries no loss. The train/eval split is two index arrays over the same map.
"""

from __future__ import annotations

import numpy as np
import torch

IGNORE_INDEX = -100  # what Hugging Face losses skip


class Rows:
    def __init__(self, tokens: np.ndarray, loss_mask: np.ndarray | None, index: np.ndarray):
        self.tokens, self.loss_mask, self.index = tokens, loss_mask, index

    @classmethod
    def of(cls, store) -> "Rows":
        return cls(store.tokens, store.loss_mask, np.arange(store.num_rows, dtype=np.int64))

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self.index), self.tokens.shape[1])

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, sel) -> "Rows":
        if torch.is_tensor(sel):
            sel = sel.numpy()
        return Rows(self.tokens, self.loss_mask, self.index[sel])

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.from_numpy(self.tokens[self.index].astype(np.int64))
        if self.loss_mask is None:
            return ids, ids
        keep = torch.from_numpy(self.loss_mask[self.index].astype(bool))
        return ids, ids.masked_fill(~keep, IGNORE_INDEX)


def loss_items(labels: torch.Tensor) -> torch.Tensor:
    """The number of targets a causal-LM loss averages over (labels shifted by one, IGNORE_INDEX skipped), at
    least 1. Given as HF's num_items_in_batch, the loss equals HF's mean bit for bit, and a micro-batch with no
    target at all (a prompt longer than seq_len) has loss 0 and no gradient instead of 0/0 = NaN."""
    return (labels[..., 1:] != IGNORE_INDEX).sum().clamp(min=1)


def split_rows(rows: Rows, eval_fraction: float, seed: int) -> tuple[Rows, Rows]:
    """(train, eval): a seeded random choice of eval rows, at least one when fraction > 0.

    Both keep the original row order, so eval rows are whole, contiguous-text rows like train rows.
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    num_rows = len(rows)
    num_eval = max(1, round(num_rows * eval_fraction)) if eval_fraction > 0 else 0
    if num_eval >= num_rows:
        raise ValueError(f"eval_fraction={eval_fraction} of {num_rows} rows leaves no training rows; "
                         "use a smaller eval_fraction or more data")
    perm = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed)).numpy()
    return rows[np.sort(perm[num_eval:])], rows[np.sort(perm[:num_eval])]
