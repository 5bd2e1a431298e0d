"""The distillation loss (train.objective gkd, distill): the generalised Jensen-Shannon divergence between the
student's and the teacher's next-token distributions at each loss token, as TRL 1.16 states it.

With s, t the student's and the teacher's logits divided by the loss temperature T (no T^2 factor), p_s, p_t their
softmaxes over the vocabulary:
    beta 0      KL(p_t || p_s) = sum_v p_t (log p_t - log p_s)                        (forward KL)
    beta 1      KL(p_s || p_t) = sum_v p_s (log p_s - log p_t)                        (reverse KL)
    otherwise   beta KL(p_t || m) + (1 - beta) KL(p_s || m),   m = (1 - beta) p_s + beta p_t
plus, when distill.ce_alpha > 0, ce_alpha x the cross-entropy of the student's raw logits (T = 1) on the dataset's
token (labels < 0: none, at the tokens of a completion the student generated itself). Every function here returns SUMS over the tokens; the step divides by the step's loss tokens over all ranks
and accumulation steps (harness/train/distill.py).

The teacher's answer for a micro-batch is a `Targets`: the logits over the whole vocabulary at the loss tokens
(teacher modes engine and adapter), or its top-k token ids and log-probs (precomputed, served). `LOSSES` maps a
target's kind to its loss; a new kind of teacher adds its entry there.

Memory: the loss runs over `chunk` tokens at a time. Each chunk's rows are up-cast to float32, the divergence and its
gradient with respect to the student's logits computed at once, and the gradient kept in the logits' own dtype; so
the float32 copies never exceed one chunk, and backward is a multiplication.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from harness.distill.topk import TopK
from harness.distill.topk_loss import topk_rows_sum


@dataclass
class Targets:
    """The teacher's answer at one micro-batch's N loss tokens, in the order of labels[:, 1:] != -100 (row-major)."""

    logits: torch.Tensor | None = None  # [N, V]: engine, adapter
    ids: torch.Tensor | None = None  # [N, k] int64: precomputed, served
    logprobs: torch.Tensor | None = None  # [N, k] float32: precomputed, served
    actual: torch.Tensor | None = None  # [N] float32, the teacher's log-prob of the token there: precomputed, served
    tokens: torch.Tensor | None = None  # [N] int64, the tokens at the loss positions: precomputed, served

    @property
    def kind(self) -> str:
        return "logits" if self.logits is not None else "topk"


def divergence(log_s: torch.Tensor, log_t: torch.Tensor, beta: float) -> torch.Tensor:
    """Per-token generalised JSD [N] of float32 log-probs [N, V] (the formulas above)."""
    if beta == 0:
        return (log_t.exp() * (log_t - log_s)).sum(-1)
    if beta == 1:
        return (log_s.exp() * (log_s - log_t)).sum(-1)
    log_m = torch.logaddexp(log_s + math.log1p(-beta), log_t + math.log(beta))
    return beta * (log_t.exp() * (log_t - log_m)).sum(-1) + (1 - beta) * (log_s.exp() * (log_s - log_m)).sum(-1)


def entropy(log_p: torch.Tensor) -> torch.Tensor:
    return -(log_p.exp() * log_p).sum(-1)


def _chunk(s: torch.Tensor, t: torch.Tensor, labels: torch.Tensor, cfg: dict) -> tuple[torch.Tensor, ...]:
    """(summed loss, student entropy sum, teacher entropy sum) of one chunk's float32 logits."""
    temp = cfg["loss_temperature"]
    log_s, log_t = torch.log_softmax(s / temp, -1), torch.log_softmax(t / temp, -1)
    loss = divergence(log_s, log_t, cfg["beta"]).sum()
    if cfg["ce_alpha"]:  # labels < 0: no CE at that token (a completion the student generated)
        picked = torch.log_softmax(s, -1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        loss = loss - cfg["ce_alpha"] * (picked * (labels >= 0)).sum()
    return loss, entropy(log_s.detach()).sum(), entropy(log_t).sum()


class _ChunkedLoss(torch.autograd.Function):
    """(loss sum, student entropy sum, teacher entropy sum) over [N, V] logits; the gradient is computed in forward,
    chunk by chunk, and only scaled in backward."""

    @staticmethod
    def forward(ctx, student, teacher, labels, cfg):
        needs_grad = ctx.needs_input_grad[0]
        grad = torch.empty_like(student) if needs_grad else None
        sums = torch.zeros(3, dtype=torch.float32, device=student.device)
        step = cfg["loss_chunk_tokens"]
        for i in range(0, student.shape[0], step):
            s = student[i:i + step].detach().float().requires_grad_(needs_grad)
            with torch.enable_grad():
                loss, ent_s, ent_t = _chunk(s, teacher[i:i + step].float(), labels[i:i + step], cfg)
            if needs_grad:
                grad[i:i + step] = torch.autograd.grad(loss, s)[0].to(grad.dtype)
            sums += torch.stack([loss.detach(), ent_s, ent_t])
        ctx.save_for_backward(grad)
        loss, ent_s, ent_t = sums.unbind()
        ctx.mark_non_differentiable(ent_s, ent_t)
        return loss, ent_s, ent_t

    @staticmethod
    def backward(ctx, grad_loss, _ent_s, _ent_t):
        (grad,) = ctx.saved_tensors
        return grad * grad_loss.to(grad.dtype), None, None, None


def full_vocabulary(student: torch.Tensor, targets: Targets, labels: torch.Tensor, cfg: dict):
    """The loss over the whole vocabulary (the teacher's logits): (loss sum, student entropy sum, teacher entropy
    sum). cfg: the resolved distill block (harness/config/distill_rules.settings)."""
    if targets.logits.shape != student.shape:
        raise ValueError(f"teacher logits {tuple(targets.logits.shape)} vs the student's {tuple(student.shape)}: "
                         "the vocabularies differ (checked before launch from their config.json)")
    return _ChunkedLoss.apply(student, targets.logits.to(student.device), labels.to(student.device), cfg)


def top_k(student: torch.Tensor, targets: Targets, labels: torch.Tensor, cfg: dict):
    """The loss over the teacher's top-k (+ tail) as TRL's server distillation computes it (harness/distill/
    topk_loss.py): (loss sum, student entropy sum, teacher entropy sum over its k + tail buckets). labels: the CE
    term's (< 0: none at that token)."""
    answer = TopK(targets.ids, targets.logprobs, targets.actual)
    return topk_rows_sum(student, targets.tokens, answer, beta=cfg["beta"], temperature=cfg["loss_temperature"],
                         add_tail=cfg["loss_add_tail"], chunk_tokens=cfg["loss_chunk_tokens"],
                         ce_alpha=cfg["ce_alpha"], ce_labels=labels)


LOSSES = {"logits": full_vocabulary, "topk": top_k}  # Targets.kind -> loss(student [N, V], targets, CE labels [N]
# (< 0: none), cfg)
