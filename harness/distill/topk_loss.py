"""The distillation loss over a teacher's top-k support, as TRL 1.16's ServerDistillationTrainer computes it
(`loss_top_k`, `loss_add_tail`), in float32, chunked over the loss tokens.

Per loss token, with the student's log-probs s = log_softmax(z / T) and the teacher's top-k targets (topk.py):
- beta 0 (forward KL): the support is the teacher's k ids; KL(t || s) over it;
- beta > 0 (k must be 1, as in TRL): the support is {the teacher's top-1, the token actually there} (one entry
  when they are the same token; only the actual token at beta 1), each side's log-prob of them from its own
  distribution; then the generalised JSD beta * KL(t || m) + (1 - beta) * KL(s || m), m = beta t + (1 - beta) s
  (beta 1: KL(s || t));
- loss_add_tail: both sides get one more bucket, log(1 - sum(exp(support log-probs))) (the sum clamped below
  1 - 1e-7 in log space, as TRL's `_add_tail_bucket`), so that top-1 is not a zero loss; without it each side is
  renormalised over the support.
Each token's divergence is summed over the support; `topk_loss_sum` returns the sum over tokens (the step divides
by the loss tokens of the whole step across ranks and accumulation steps). Only one chunk's [tokens, vocab]
float32 log-probs is alive at a time, in the forward and (recomputed under checkpoint) in the backward.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from harness.distill.topk import CHUNK_TOKENS, TopK, loss_positions

TAIL_MAX_LOG_SUM = -1e-7  # TRL's clamp: the support never holds all of the mass


def check_support(beta: float, k: int) -> None:
    """TRL's rule: beyond the forward KL (beta 0) the loss is defined on the top-1 support only."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta {beta} is outside [0, 1]")
    if beta > 0 and k != 1:
        raise ValueError(f"a top-k teacher with beta {beta} > 0 needs k = 1 (got k = {k}): the mixed and reverse "
                         "divergences need the teacher's log-probs of the student's tokens, which a top-k teacher "
                         "gives only for its own top-1 and the token actually there")


def _with_tail(logps: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    log_sum = torch.logsumexp(logps, dim=-1, keepdim=True).clamp(max=TAIL_MAX_LOG_SUM)
    tail = torch.log(-torch.expm1(log_sum))
    return torch.cat([logps, tail], dim=-1), torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)


def _renormalised(logps: torch.Tensor) -> torch.Tensor:
    return logps - torch.logsumexp(logps, dim=-1, keepdim=True)


def divergence(s: torch.Tensor, t: torch.Tensor, mask: torch.Tensor, beta: float) -> torch.Tensor:
    """[N, S] terms of the generalised JSD of log-probs s (student) and t (teacher) on the support `mask`."""
    zero = torch.zeros((), dtype=s.dtype, device=s.device)
    s0, t0 = torch.where(mask, s, zero), torch.where(mask, t, zero)
    ps, pt = torch.where(mask, s.exp(), zero), torch.where(mask, t.exp(), zero)
    if beta == 0:
        return torch.nan_to_num(pt * (t0 - s0), nan=0.0)
    if beta == 1:
        return torch.nan_to_num(ps * (s0 - t0), nan=0.0)
    mix = (1 - beta) * ps + beta * pt
    log_mix = torch.where(mask, torch.log(mix.clamp_min(torch.finfo(s.dtype).tiny)), zero)
    kl_t = torch.nan_to_num(pt * (t0 - log_mix), nan=0.0)
    kl_s = torch.nan_to_num(ps * (s0 - log_mix), nan=0.0)
    return beta * kl_t + (1 - beta) * kl_s


def support(targets: TopK, actual_ids: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [N, S], mask [N, S], teacher log-probs [N, S]) of each token's support."""
    if beta == 0:
        return targets.ids, targets.logps > float("-inf"), targets.logps
    if beta == 1:
        return actual_ids[:, None], torch.ones_like(actual_ids[:, None], dtype=torch.bool), targets.actual[:, None]
    ids = torch.stack([targets.ids[:, 0], actual_ids], dim=1)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[:, 1] = ids[:, 1] != ids[:, 0]
    return torch.where(mask, ids, torch.zeros_like(ids)), mask, torch.stack([targets.logps[:, 0], targets.actual], 1)


def _entropy(logps: torch.Tensor) -> torch.Tensor:
    return -(logps.exp() * logps).nan_to_num(nan=0.0).sum(-1)


def _chunk_sums(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, teacher: torch.Tensor,
                ce_labels: torch.Tensor, beta: float, temperature: float, add_tail: bool,
                ce_alpha: float) -> tuple[torch.Tensor, ...]:
    """(loss sum, student entropy sum, teacher entropy sum over its top-k + tail buckets) of one chunk."""
    neg_inf = torch.full((), float("-inf"), device=logits.device)
    full = torch.log_softmax(logits.float() / temperature, dim=-1)
    s, t = torch.where(mask, full.gather(-1, ids), neg_inf), torch.where(mask, teacher, neg_inf)
    if add_tail:
        s, bucket_mask = _with_tail(s, mask)
        t, _ = _with_tail(t, mask)
    else:
        s, t, bucket_mask = _renormalised(s), _renormalised(t), mask
    loss = divergence(s, t, bucket_mask, beta).sum()
    if ce_alpha:  # ce_labels < 0: no CE at that token
        picked = torch.log_softmax(logits.float(), -1).gather(-1, ce_labels.clamp(min=0)[:, None])[:, 0]
        loss = loss - ce_alpha * (picked * (ce_labels >= 0)).sum()
    return loss, _entropy(full.detach()).sum(), _entropy(torch.where(bucket_mask, t, neg_inf)).sum()


def topk_rows_sum(student: torch.Tensor, actual_ids: torch.Tensor, targets: TopK, *, beta: float, temperature: float,
                  add_tail: bool = True, chunk_tokens: int = CHUNK_TOKENS, ce_alpha: float = 0.0,
                  ce_labels: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss sum, student entropy sum, teacher entropy sum) over N loss tokens: the student's logits [N, V] at them,
    the tokens actually there [N] and the teacher's targets. ce_alpha: plus that weight x the cross-entropy of the
    student's raw logits (T = 1) on ce_labels [N] (default the actual tokens; < 0: none at that token). float32
    scalars; the entropies carry no gradient."""
    check_support(beta, targets.k)
    if student.shape[0] != len(targets):
        raise ValueError(f"the teacher gave {len(targets)} targets for {student.shape[0]} loss tokens")
    if beta > 0 and not bool(torch.isfinite(targets.actual).all()):
        raise ValueError("the teacher gave no log-prob for some of the actual tokens (needed when beta > 0)")
    device = student.device
    actual_ids = actual_ids.to(device)
    ce_labels = actual_ids if ce_labels is None else ce_labels.to(device)
    ids, mask, teacher = (x.to(device) for x in support(targets, actual_ids, beta))
    sums = [torch.zeros((), dtype=torch.float32, device=device) for _ in range(3)]
    for start in range(0, student.shape[0], chunk_tokens):
        sl = slice(start, start + chunk_tokens)
        args = (student[sl], ids[sl], mask[sl], teacher[sl].float(), ce_labels[sl], beta, temperature, add_tail,
                ce_alpha)
        part = (checkpoint(_chunk_sums, *args, use_reentrant=False) if student.requires_grad
                else _chunk_sums(*args))
        sums = [a + b for a, b in zip(sums, part)]
    return sums[0], sums[1].detach(), sums[2].detach()


def topk_loss_sum(logits: torch.Tensor, labels: torch.Tensor, targets: TopK, *, beta: float, temperature: float,
                  add_tail: bool = True, chunk_tokens: int = CHUNK_TOKENS) -> torch.Tensor:
    """Sum over the loss tokens of labels [B, L] of the student's divergence from the teacher's top-k targets
    (one row per loss token, in loss_positions' order); logits [B, L, V]. float32 scalar."""
    rows, pos = loss_positions(labels)
    actual_ids = labels[:, 1:].to(logits.device)[rows, pos]
    return topk_rows_sum(logits[rows, pos], actual_ids, targets, beta=beta, temperature=temperature,
                         add_tail=add_tail, chunk_tokens=chunk_tokens)[0]
