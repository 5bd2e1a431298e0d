"""Rows of a token store as the trainer sees them: a view (an index array) over the memory map.

`split[rows]` (a slice, or a LongTensor / array of positions) is another view, no data copied;
`split.tensors()` reads just those rows. The train/eval split is two index arrays over the same map.

train.packing (PACKINGS) decides what `tensors()` yields:
    concat    (input_ids, labels): LongTensors [n, seq_len], labels -100 where the token carries no loss. Packed
              documents attend to each other (the corpus joined and cut into rows, as before document packing).
    document  (input_ids, labels, position_ids): position_ids int64 [n, seq_len] restart at 0 at every document
              start, and each document's first label is -100, so nothing is predicted across a boundary. The
              model is called with these position_ids, use_cache=False and NO attention_mask: transformers then
              finds the documents from the position ids (masking_utils.find_packed_sequence_indices) and keeps
              the attention inside each one. A row that starts mid-document restarts at 0 too: positions stay
              below seq_len (what max_position_embeddings is checked against; GPT-2's learned positions would
              index past it otherwise), and the fragment is exactly a document of its own: its first label is
              never a target anyway (a causal LM's labels are shifted by one), which is the -100 rule again.
              With rotary positions the losses equal those of the continuing offsets (only differences matter), and
              flash-attention's varlen path (prepare_fa_kwargs_from_position_ids) starts a sequence wherever the
              position id equals the row's minimum: a row must start at 0 for it to see its first fragment.
The position ids come from doc_index.bin (the end offset of every document, memory-mapped) by a searchsorted
per row at read time: nothing is stored per token and nothing per corpus is held beyond the map.
"""

from __future__ import annotations

import numpy as np
import torch

IGNORE_INDEX = -100  # what Hugging Face losses skip
PACKINGS = ("document", "concat")  # train.packing; the schema's default is the first


def document_starts(doc_ends: np.ndarray, row: int, seq_len: int) -> np.ndarray:
    """Offsets inside row `row` (0 < offset < seq_len) where a document starts: the ends of the documents
    before them, found by a binary search of the memory-mapped ends (reads a few pages, not the index)."""
    lo_off, hi_off = row * seq_len, (row + 1) * seq_len
    lo = int(np.searchsorted(doc_ends, lo_off, side="right"))
    hi = int(np.searchsorted(doc_ends, hi_off, side="left"))
    return np.asarray(doc_ends[lo:hi], dtype=np.int64) - lo_off


def document_positions(starts_per_row: list[np.ndarray], seq_len: int) -> torch.Tensor:
    """Position ids [n, seq_len] restarting at 0 at offset 0 and at every start of each row."""
    marks = np.zeros((len(starts_per_row), seq_len), dtype=np.int64)
    for i, starts in enumerate(starts_per_row):
        marks[i, starts] = starts
    return torch.from_numpy(np.arange(seq_len, dtype=np.int64) - np.maximum.accumulate(marks, axis=1))


class Rows:
    def __init__(self, tokens: np.ndarray, loss_mask: np.ndarray | None, index: np.ndarray,
                 doc_ends: np.ndarray | None = None):
        """doc_ends None: concat packing (2-tuples); the store's document ends: document packing (3-tuples)."""
        self.tokens, self.loss_mask, self.index, self.doc_ends = tokens, loss_mask, index, doc_ends

    @classmethod
    def of(cls, store, packing: str = "concat") -> "Rows":
        if packing not in PACKINGS:
            raise ValueError(f"packing must be one of {PACKINGS}, got {packing!r}")
        if packing == "document" and store.doc_ends is None:
            raise ValueError(f"store {store.path} has no document index; document packing needs doc_index.bin")
        return cls(store.tokens, store.loss_mask, np.arange(store.num_rows, dtype=np.int64),
                   store.doc_ends if packing == "document" else None)

    @property
    def packing(self) -> str:
        return "concat" if self.doc_ends is None else "document"

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self.index), self.tokens.shape[1])

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, sel) -> "Rows":
        if torch.is_tensor(sel):
            sel = sel.numpy()
        return Rows(self.tokens, self.loss_mask, self.index[sel], self.doc_ends)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """concat: (input_ids, labels); document: (input_ids, labels, position_ids) (see the module docstring)."""
        ids = torch.from_numpy(self.tokens[self.index].astype(np.int64))
        labels = ids
        if self.loss_mask is not None:
            keep = torch.from_numpy(self.loss_mask[self.index].astype(bool))
            labels = ids.masked_fill(~keep, IGNORE_INDEX)
        if self.doc_ends is None:
            return ids, labels
        seq_len = self.tokens.shape[1]
        starts = [document_starts(self.doc_ends, int(row), seq_len) for row in self.index]
        labels = labels.clone()
        for i, row_starts in enumerate(starts):
            labels[i, row_starts] = IGNORE_INDEX  # a document's first token is never predicted from the last one
        return ids, labels, document_positions(starts, seq_len)


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


def model_inputs(batch: tuple[torch.Tensor, ...], device=None) -> dict:
    """The HF forward's keyword arguments for a batch of `tensors()`: input_ids, labels, and position_ids under
    document packing; never an attention_mask (it would switch transformers' packed-document detection off)."""
    names = ("input_ids", "labels", "position_ids")
    return {name: (t if device is None else t.to(device)) for name, t in zip(names, batch)}
