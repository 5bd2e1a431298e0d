"""Preference pairs as the trainer sees them, when train.objective is dpo, ipo, simpo or orpo.

Records become pairs in harness/data/preference_records.py (TRL's joining rules) and are stored once, padded to
train.seq_len, in harness/data/preference_store.py. `Pairs` is a view over that store that quacks like
harness/data/rows.Rows, so batches (BatchPlan over len(pairs)), the train/eval split (split_rows) and the data
checks work unchanged; a micro-batch of B pairs is 2B sequences:
    pairs.shape               (pairs, seq_len)
    pairs[sel]                another view (a slice, a LongTensor or an int array of positions), no copy
    pairs.tensors()           (input_ids, labels), LongTensors [2B, seq_len]: the B chosen rows first, then the
                              B rejected rows in the same order, so both sides of a pair share a micro-batch.
                              labels are IGNORE_INDEX on the prompt and the padding (right, to seq_len): only
                              the completion (and its eos) is a target. Fixed shapes, as pipeline and sequence
                              parallel need.
    pairs.ids                 LongTensor [B]: each pair's row in the whole store (train and eval together);
                              stable for a store key: the key of the precomputed reference cache and of reports
    pairs.completion_tokens() LongTensor [2B]: each row's scored targets, labels[:, 1:] != IGNORE_INDEX (a causal
                              LM's shift: the divisor of IPO's and SimPO's per-token averages)
    pairs.records             int64 [B]: the dataset record each pair came from (for messages)
    pairs.path, .store_dir    the store folder (the precomputed reference cache is kept in it)
"""

from __future__ import annotations

import numpy as np
import torch

from harness.data.rows import IGNORE_INDEX, split_rows


class Pairs:
    def __init__(self, store: dict, index: np.ndarray):
        self.store, self.index = store, index

    @classmethod
    def of(cls, store: dict) -> "Pairs":
        return cls(store, np.arange(store["meta"]["pairs"], dtype=np.int64))

    @property
    def path(self):
        return self.store["path"]

    @property
    def store_dir(self):
        """The folder the reference's precomputed log-probs are cached in: the pairs' store itself."""
        return self.store["path"]

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self.index), self.store["meta"]["seq_len"])

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, sel) -> "Pairs":
        if torch.is_tensor(sel):
            sel = sel.numpy()
        return Pairs(self.store, self.index[sel])

    @property
    def ids(self) -> torch.Tensor:
        return torch.from_numpy(self.index.copy())

    @property
    def records(self) -> np.ndarray:
        return np.asarray(self.store["records"][self.index])

    def _bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(start, end) [2B] of each row's labels, chosen rows first."""
        bounds = torch.from_numpy(np.asarray(self.store["bounds"][self.index], dtype=np.int64))
        start = bounds[:, 0].repeat(2)
        return start, torch.cat([bounds[:, 1], bounds[:, 2]])

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [self.store[side][self.index].astype(np.int64) for side in ("chosen", "rejected")]
        ids = torch.from_numpy(np.concatenate(rows, axis=0))
        start, end = self._bounds()
        where = torch.arange(ids.shape[1])
        target = (where >= start[:, None]) & (where < end[:, None])
        return ids, ids.masked_fill(~target, IGNORE_INDEX)

    def completion_tokens(self) -> torch.Tensor:
        start, end = self._bounds()
        return (end - start.clamp(min=1)).clamp(min=0)  # position 0 is never a target after the shift


def notes(meta: dict, truncation: str) -> list[str]:
    """The start-up lines about the pairs: counts, what was cut or left out, and why."""
    line = (f"{meta['pairs']} pairs from {meta['records']} records (train.seq_len {meta['seq_len']}, "
            f"preference.truncation {truncation}): {meta['truncated']} truncated at the completion's end")
    if truncation == "drop":
        line += (f", {meta['dropped_long'] + meta['dropped_prompt']} dropped ({meta['dropped_long']} longer than "
                 f"seq_len, {meta['dropped_prompt']} whose prompt fills it)")
    out = [line]
    if meta["identical"]:
        out.append(f"warning: {meta['identical']} pairs have the same chosen and rejected tokens: their reward "
                   "margin is 0 whatever the weights (kept, as TRL keeps them)")
    if meta["mismatched"]:
        out.append(f"warning: in {meta['mismatched']} pairs the prompt's tokens are not a prefix of prompt + "
                   "completion's (the tokenizer merges across the join); prompt ids + the tail were kept, as TRL does")
    return out


def load_pairs(spec, dist, tokenizer) -> tuple[Pairs, Pairs, list[str]]:
    """(train, eval, notes) of the run's preference data: the store prepared once per node (local rank 0, in a
    child process; the others wait on the file system), split by train.eval_fraction as LM rows are."""
    import time

    from harness.data.corpus import DataSpec
    from harness.data.preference_store import ensure_pairs

    start = time.perf_counter()
    train, truncation = spec.recipe["train"], spec.recipe["preference"]["truncation"]
    data_spec = DataSpec.from_train(train)
    store, made = ensure_pairs(data_spec, tokenizer, train["seq_len"], truncation, train["store_dir"] or None,
                               dist.local_rank)
    train_pairs, eval_pairs = split_rows(Pairs.of(store), train["eval_fraction"], train["seed"])
    meta = store["meta"]
    lines = [f"{'prepared' if made else 'using'} preference store {store['path']} ({meta['dtype']}); data ready in "
             f"{time.perf_counter() - start:.2f}s", *notes(meta, truncation)]
    return train_pairs, eval_pairs, lines
