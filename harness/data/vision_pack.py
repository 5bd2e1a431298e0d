"""Packing for the vision store (harness/data/vision_store.py): several conversations per row, each with its image
tokens whole, and the per-document positions that keep them apart.

Write time (`Packer`): conversations are laid into rows of seq_len in record order; one that does not fit in what is
left of the row starts a new row (the rest of the row is padding, never a target), so a conversation, and with it
every image placeholder span, is never split across rows. A row's images are its conversations' images in order,
which is the order of the placeholder spans in the row. A conversation longer than seq_len is cut at seq_len when
no image span reaches past it (counted as truncated, as a text-only one always was) and refused with the arithmetic
when one would be cut (its image tokens would lose their features).

Read time (`document_tensors`), train.packing as for text rows (harness/data/rows.py):
    document  position ids restart at 0 at each conversation's start (and at the padding after the last one, a
              segment of its own), each conversation's first label is -100. The model gets these positions and no
              attention_mask; transformers keeps attention inside each conversation (the same detection from position
              ids as the text path). Qwen-VL's 3-D rotary positions are computed per conversation from them
              (harness/model/vision_positions.py).
    concat    the packed rows as they are: conversations attend to the ones before them in the row.
"""

from __future__ import annotations

import numpy as np
import torch

from harness.data.rows import IGNORE_INDEX, document_positions
from harness.errors import UsageError


def fit(enc, seq_len: int, image_token, where: str):
    """(the conversation, truncated?): cut at seq_len where no image span reaches past it, refused where one does.
    image_token: the image token, or a tuple of the placeholder tokens (image and video: a video span alike)."""
    if len(enc.ids) <= seq_len:
        return enc, False
    tokens = image_token if isinstance(image_token, tuple) else (image_token,)
    marks = [i for i, t in enumerate(enc.ids) if t in tokens]
    if marks and marks[-1] >= seq_len:
        first = next(i for i in range(marks[-1], -1, -1) if i == 0 or enc.ids[i - 1] not in tokens)
        raise UsageError(f"{where}: {len(enc.ids)} tokens with its image tokens, more than train.seq_len {seq_len}, "
                         f"and its image span at tokens {first}..{marks[-1]} reaches past token {seq_len - 1} (a row "
                         "never cuts an image span: its tokens would lose their features)\n    fix: raise "
                         f"train.seq_len to at least {len(enc.ids)} (or {marks[-1] + 1} to keep the images and cut "
                         "the text after them), or give the image processor a smaller max_pixels / size")
    enc.ids, enc.mask = enc.ids[:seq_len], enc.mask[:seq_len]
    return enc, True


class Packer:
    """Rows of seq_len, filled with whole conversations in record order (module docstring)."""

    def __init__(self, seq_len: int, pad: int):
        self.seq_len, self.pad = seq_len, pad
        self.tokens, self.masks, self.row_docs, self.doc_bounds, self.doc_images = [], [], [0], [], [0]
        self.ids, self.mask = [], []  # the row being filled

    def _flush(self) -> None:
        if not self.ids:
            return
        row = np.full(self.seq_len, self.pad, dtype=np.int32)
        row[:len(self.ids)] = self.ids
        mask = np.zeros(self.seq_len, dtype=np.uint8)
        mask[:len(self.mask)] = self.mask
        self.tokens.append(row), self.masks.append(mask), self.row_docs.append(len(self.doc_bounds))
        self.ids, self.mask = [], []

    def add(self, enc) -> None:
        """Lay one conversation (at most seq_len tokens) into the rows."""
        if self.ids and len(self.ids) + len(enc.ids) > self.seq_len:
            self._flush()
        self.doc_bounds.append((len(self.ids), len(self.ids) + len(enc.ids)))
        self.doc_images.append(self.doc_images[-1] + len(enc.pixels))
        self.ids += enc.ids
        self.mask += enc.mask

    def arrays(self) -> dict:
        """tokens, mask, row_docs (row r holds conversations row_docs[r]:row_docs[r + 1]), doc_bounds ([start, end)
        in its row) and row_images (row r's images are images[row_images[r]:row_images[r + 1]])."""
        self._flush()
        row_docs = np.asarray(self.row_docs, dtype=np.int64)
        return {"tokens": np.stack(self.tokens), "mask": np.stack(self.masks), "row_docs": row_docs,
                "doc_bounds": np.asarray(self.doc_bounds, dtype=np.int64).reshape(-1, 2),
                "row_images": np.asarray(self.doc_images, dtype=np.int64)[row_docs]}


def row_starts(store: dict, row: int, seq_len: int) -> np.ndarray:
    """Offsets in `row` where a segment starts: each conversation, and the padding after the last one."""
    bounds = np.array(store["doc_bounds"][int(store["row_docs"][row]):int(store["row_docs"][row + 1])])  # a copy
    starts = bounds[:, 0]
    return np.append(starts, bounds[-1, 1]) if bounds[-1, 1] < seq_len else starts


def document_tensors(store: dict, index: np.ndarray, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(labels with each conversation's first token -100, position ids [n, seq_len] restarting per segment)."""
    seq_len = labels.shape[1]
    starts = [row_starts(store, int(r), seq_len) for r in index]
    labels = labels.clone()
    for i, row in enumerate(starts):
        labels[i, row] = IGNORE_INDEX  # never predicted from the conversation before it
    return labels, document_positions(starts, seq_len)
