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


TURN_SALT = 0x5DEECE66D  # keeps a later turn's streams apart from every first-turn stream


def row_seed(seed: int, row: int) -> int:
    return (int(seed) * SEED_STRIDE + int(row)) & SEED_MASK


def turn_seed(seed: int, turn: int) -> int:
    """The seed of a multi-turn rollout's turn: the generation's own seed for turn 0 (a single-turn run draws as
    before), a distinct one per later turn, so each (seed, generation, global row, turn) has a stream of its own."""
    return int(seed) if turn == 0 else (int(seed) * SEED_STRIDE + TURN_SALT + int(turn)) & SEED_MASK


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

    BLOCK = 64  # uniforms drawn per row at a time: one small draw per row per 64 tokens, not one per token

    def __init__(self, *, seed: int, first_row: int = 0, rows: int = 0, row_ids: list[int] | None = None,
                 temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                 record_logps: bool = False):
        """Row i draws from (seed, row_ids[i]) when row_ids is given (rows of a multi-turn rollout that are still
        going: not contiguous), else from (seed, first_row + i)."""
        ids = list(row_ids) if row_ids is not None else [first_row + i for i in range(rows)]
        self.streams = [torch.Generator().manual_seed(row_seed(seed, r)) for r in ids]
        self.warpers = warpers(temperature, top_k, top_p)
        self.uniforms, self.used = torch.empty(len(ids), 0, dtype=torch.float64), 0
        self.record_logps = record_logps
        self.logps: list[torch.Tensor] = []  # per generated position: [rows] log-prob of the drawn token

    def _uniform(self) -> torch.Tensor:
        """[rows, 1]: the next uniform of each row's stream (drawn BLOCK at a time per row)."""
        if self.used == self.uniforms.shape[1]:
            self.uniforms = torch.stack([torch.rand(self.BLOCK, generator=g, dtype=torch.float64)
                                         for g in self.streams])
            self.used = 0
        self.used += 1
        return self.uniforms[:, self.used - 1:self.used]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Inverse-CDF sampling of every row at once, each from its own uniform: the pick of row i depends only
        on its stream and its probabilities, however the rows are batched."""
        scores = scores.float()
        for warp in self.warpers:
            scores = warp(input_ids, scores)
        cdf = torch.softmax(scores, dim=-1).double().cumsum(-1)
        u = self._uniform().to(cdf.device) * cdf[:, -1:]
        picked = torch.searchsorted(cdf, u, right=True).clamp(max=scores.shape[1] - 1)
        picked = torch.where(torch.isneginf(scores.gather(1, picked)), scores.argmax(-1, keepdim=True), picked)
        if self.record_logps:  # the drawn token's log-prob under the warped distribution (rollouts' sampling_logps)
            self.logps.append(torch.log_softmax(scores, dim=-1).gather(1, picked).squeeze(1).cpu())
        out = torch.full_like(scores, float("-inf"))
        out.scatter_(1, picked, 0.0)
        return out
