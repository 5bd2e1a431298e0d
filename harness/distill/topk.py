"""A teacher's top-k targets: for every loss token of a micro-batch, the k most likely next tokens under the
teacher at temperature T (ids and log-probs, most likely first) and the log-prob of the token actually there.

Loss tokens follow HF's LM loss: labels [B, L] with -100 where no loss; the token at position t is predicted by
the logits at t - 1. They are taken row by row, position ascending (`loss_positions`): the order of every
`TopK`, of the precomputed store and of the served teacher's answers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

CHUNK_TOKENS = 1024  # loss tokens whose [tokens, vocab] float32 log-probs are alive at once


@dataclass(frozen=True)
class TopK:
    ids: torch.Tensor  # [N, k] int64, the teacher's k most likely next tokens, most likely first
    logps: torch.Tensor  # [N, k] float32, their log-probs at the temperature (-inf pads a position given fewer)
    actual: torch.Tensor  # [N] float32, the log-prob of the token actually at each position (the reverse KL's)

    @property
    def k(self) -> int:
        return self.ids.shape[1]

    def __len__(self) -> int:
        return self.ids.shape[0]

    @staticmethod
    def cat(parts: list["TopK"], k: int) -> "TopK":
        if not parts:
            return TopK(torch.zeros(0, k, dtype=torch.int64), torch.zeros(0, k), torch.zeros(0))
        return TopK(*(torch.cat([getattr(p, f) for p in parts]) for f in ("ids", "logps", "actual")))

    def numpy(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.ids.numpy(), self.logps.numpy(), self.actual.numpy()


def loss_positions(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, positions) of the logits that predict a loss token, row-major: logits[rows, positions] predicts
    labels[rows, positions + 1]."""
    rows, pos = torch.nonzero(labels[:, 1:] != -100, as_tuple=True)
    return rows, pos


def tokens_per_row(labels: torch.Tensor) -> torch.Tensor:
    """[B] int64: the loss tokens of each row."""
    return (labels[:, 1:] != -100).sum(dim=1)


@torch.no_grad()
def teacher_topk(logits: torch.Tensor, labels: torch.Tensor, k: int, temperature: float,
                 chunk_tokens: int = CHUNK_TOKENS) -> TopK:
    """The top-k targets of a teacher's logits [B, L, V] for the loss tokens of labels [B, L], from
    log_softmax(logits / T) in float32, CHUNK_TOKENS tokens at a time."""
    rows, pos = loss_positions(labels)
    targets = labels[:, 1:].to(logits.device)[rows, pos]
    ids, logps, actual = [], [], []
    for start in range(0, rows.numel(), chunk_tokens):
        end = start + chunk_tokens
        lp = torch.log_softmax(logits[rows[start:end], pos[start:end]].float() / temperature, dim=-1)
        top = lp.topk(k, dim=-1)
        ids.append(top.indices.cpu())
        logps.append(top.values.cpu())
        actual.append(lp.gather(-1, targets[start:end, None])[:, 0].cpu())
    return TopK.cat([TopK(i, lp, a) for i, lp, a in zip(ids, logps, actual)], k)
