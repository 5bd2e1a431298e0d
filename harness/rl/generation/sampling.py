"""Seeded sampling that does not depend on how rows are batched: row i of a call draws from its own torch.Generator
seeded by (seed, first_row + i), so a completion depends on its seed, its prompt and the weights, not on which rank
or batch position produced it (a run resumed on another world size samples the same completions).

HF generate runs greedy (do_sample=False) with `RowSampler` as its last logits processor: the sampler applies TRL's
temperature, top-k and top-p with transformers' own warpers, draws one token per row from the row's stream, and
returns scores that are -inf everywhere but the drawn token, so generate's argmax takes it."""

from __future__ import annotations

import torch

SEED_STRIDE = 1_000_003  # a prime: (seed, row) pairs map to distinct stream seeds for any realistic row count
SEED_MASK = (1 << 63) - 1


def row_seed(seed: int, row: int) -> int:
    return (int(seed) * SEED_STRIDE + int(row)) & SEED_MASK


def warpers(temperature: float, top_k: int | None, top_p: float | None) -> list:
    """transformers' own warpers for TRL's sampling keys (top_k 0 or None: off; top_p 1.0: off)."""
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    out = []
    if temperature != 1.0:
        out.append(TemperatureLogitsWarper(float(temperature)))
    if top_k:
        out.append(TopKLogitsWarper(int(top_k)))
    if top_p is not None and float(top_p) < 1.0:
        out.append(TopPLogitsWarper(float(top_p)))
    return out


class RowSampler:
    """A transformers LogitsProcessor (duck-typed: __call__(input_ids, scores)) drawing each row from its stream."""

    def __init__(self, *, seed: int, first_row: int, rows: int, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None):
        self.streams = [torch.Generator().manual_seed(row_seed(seed, first_row + i)) for i in range(rows)]
        self.warpers = warpers(temperature, top_k, top_p)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.float()
        for warp in self.warpers:
            scores = warp(input_ids, scores)
        probs = torch.softmax(scores, dim=-1).cpu()
        picked = [torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(self.streams)]
        out = torch.full_like(scores, float("-inf"))
        out.scatter_(1, torch.stack(picked).to(out.device), 0.0)
        return out
