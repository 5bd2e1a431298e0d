"""Preference pairs for the preference tests: a tiny record file, and a STAND-IN for harness.data.preference used
only until engineer prefdata's module lands (tests/drivers/preference_jobs.py installs it when the real one is
missing). It follows the agreed contract: Pairs.shape == (pairs, seq_len); pairs[rows] a view; tensors() ->
(input_ids, labels) [2B, seq_len], the B chosen rows first, right-padded, labels -100 on prompt and padding;
.ids the pair's index in the whole set; load_pairs(spec, dist, tokenizer) -> (train, eval, notes)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch

WORDS = ("the cat sat on a mat while river stones hum quietly under green light and every clock ticks "
         "toward noon but birds argue about bread crumbs near old wooden benches").split()


def write_pairs(path: Path, count: int = 16, seed: int = 5) -> Path:
    rng = random.Random(seed)
    phrase = lambda lo, hi: " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))  # noqa: E731
    with open(path, "w") as f:
        for _ in range(count):
            f.write(json.dumps({"prompt": phrase(2, 5), "chosen": phrase(2, 8), "rejected": phrase(2, 8)}) + "\n")
    return Path(path)


class Pairs:
    def __init__(self, chosen: np.ndarray, rejected: np.ndarray, prompt_len: np.ndarray, ids: np.ndarray,
                 lengths: np.ndarray, pad: int):
        self.chosen, self.rejected, self.prompt_len, self._ids, self.lengths = chosen, rejected, prompt_len, ids, lengths
        self.pad = pad

    @property
    def shape(self) -> tuple[int, int]:
        return self.chosen.shape

    def __len__(self) -> int:
        return self.chosen.shape[0]

    def __getitem__(self, sel) -> "Pairs":
        if torch.is_tensor(sel):
            sel = sel.numpy()
        return Pairs(self.chosen[sel], self.rejected[sel], self.prompt_len[sel], self._ids[sel], self.lengths[sel],
                     self.pad)

    @property
    def ids(self) -> torch.Tensor:
        return torch.from_numpy(self._ids.astype(np.int64))

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.from_numpy(np.concatenate([self.chosen, self.rejected]).astype(np.int64))
        prompt = np.concatenate([self.prompt_len, self.prompt_len])
        ends = np.concatenate([self.lengths[:, 0], self.lengths[:, 1]])
        pos = np.arange(ids.shape[1])[None, :]
        keep = torch.from_numpy((pos >= prompt[:, None]) & (pos < ends[:, None]))
        return ids, ids.masked_fill(~keep, -100)

    def completion_tokens(self) -> torch.Tensor:
        return torch.from_numpy(np.concatenate([self.lengths[:, 0], self.lengths[:, 1]]) -
                                np.concatenate([self.prompt_len, self.prompt_len]))


def build_pairs(dataset: str, tokenizer, seq_len: int) -> Pairs:
    """Every record as prompt tokens + completion tokens + eos, the completion cut to fit seq_len."""
    eos, records = tokenizer.eos_token_id, [json.loads(line) for line in open(dataset)]
    n = len(records)
    out = {"chosen": np.full((n, seq_len), eos, np.int64), "rejected": np.full((n, seq_len), eos, np.int64)}
    prompt_len, lengths = np.zeros(n, np.int64), np.zeros((n, 2), np.int64)
    for i, rec in enumerate(records):
        prompt = tokenizer(rec["prompt"], add_special_tokens=False)["input_ids"]
        prompt_len[i] = len(prompt)
        for side, key in enumerate(("chosen", "rejected")):
            completion = tokenizer(" " + rec[key], add_special_tokens=False)["input_ids"] + [eos]
            row = (prompt + completion)[:seq_len]
            out[key][i, :len(row)] = row
            lengths[i, side] = len(row)
    return Pairs(out["chosen"], out["rejected"], prompt_len, np.arange(n), lengths, eos)


def split(pairs: Pairs, eval_fraction: float) -> tuple[Pairs, Pairs]:
    n_eval = int(pairs.shape[0] * eval_fraction)
    cut = pairs.shape[0] - n_eval
    return pairs[np.arange(cut)], pairs[np.arange(cut, pairs.shape[0])]


def load_pairs(spec, dist, tokenizer):
    train = spec.recipe["train"]
    pairs = build_pairs(train["dataset"], tokenizer, train["seq_len"])
    train_pairs, eval_pairs = split(pairs, train["eval_fraction"])
    train_pairs.store_dir = eval_pairs.store_dir = str(Path(train["dataset"]).parent / "pair_store")
    return train_pairs, eval_pairs, [f"stand-in pairs: {train_pairs.shape[0]} train / {eval_pairs.shape[0]} eval"]
