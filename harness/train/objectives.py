"""Preference objectives (train.objective dpo, ipo, simpo, orpo): per-row log-probs and the losses, as TRL states them.

Rows come as 2B: the B chosen completions first, then the B rejected ones in the same order (harness/data/
preference.py). A side's log-prob is the SUM over its completion's tokens (labels != -100: prompt and padding carry
none); IPO, SimPO and ORPO use the per-token average (sum / count). The metrics are TRL's: rewards = beta x the
log-ratio each loss uses (per side, mean over pairs), margin = chosen - rejected, accuracy with a strict > (ties
count wrong), logps = the policy's summed log-probs (mean over pairs).

`label_logps` never holds a float32 copy of the [2B, L, V] logits: one row is up-cast at a time, in forward for
the label logit minus logsumexp and in backward for the softmax (the tiled loss's idea, harness/model/sequence/
loss.py), so bf16 logits cost only themselves.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F



class _LabelLogps(torch.autograd.Function):
    """log softmax(logits)[label] per token, row by row: [N, T, V] logits, [N, T] labels (>= 0) -> [N, T] in float32
    (float64 logits: float64)."""

    @staticmethod
    def forward(ctx, logits, labels):
        wide = torch.promote_types(logits.dtype, torch.float32)  # bf16 / fp16 logits: one row up-cast at a time
        out = torch.empty(labels.shape, dtype=wide, device=logits.device)
        lse = torch.empty_like(out)
        for i in range(logits.shape[0]):
            row = logits[i].to(wide)
            lse[i] = torch.logsumexp(row, dim=-1)
            out[i] = row.gather(-1, labels[i].unsqueeze(-1)).squeeze(-1) - lse[i]
        ctx.save_for_backward(logits, labels, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        logits, labels, lse = ctx.saved_tensors
        out = torch.empty_like(logits)
        for i in range(logits.shape[0]):
            g = grad[i].unsqueeze(-1)
            row = -torch.exp(logits[i].to(lse.dtype) - lse[i].unsqueeze(-1)) * g
            row.scatter_add_(-1, labels[i].unsqueeze(-1), g)
            out[i] = row.to(out.dtype)
        return out, None


def label_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-prob of each row's label tokens [N] float64, their count [N]) from logits [N, L, V] and labels
    [N, L] (-100: no loss); the token at position t is predicted by the logits at t - 1, as in HF's LM loss. Summed
    in float64: a ~100-nat sum in float32 is 4e-6 off, which a reward (beta x a difference of two) would carry."""
    logits, labels = logits[:, :-1], labels[:, 1:].to(logits.device)
    mask = labels != -100
    per_token = _LabelLogps.apply(logits, labels.clamp(min=0))
    return (per_token.double() * mask).sum(-1), mask.sum(-1)


def _halves(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    half = t.shape[0] // 2
    return t[:half], t[half:]


def _sigmoid_loss(logits: torch.Tensor, smoothing: float) -> torch.Tensor:
    """TRL's `sigmoid` loss; label_smoothing > 0 is robust (conservative) DPO."""
    return -F.logsigmoid(logits) * (1 - smoothing) - F.logsigmoid(-logits) * smoothing


def preference_loss(objective: str, pref: dict, logps: torch.Tensor, counts: torch.Tensor,
                    ref_logps: torch.Tensor | None) -> tuple[torch.Tensor, dict]:
    """(loss, metrics) of one micro-batch, computed in the dtype of logps (float64 from label_logps; the loss is
    returned in float32 for the engine). logps, counts: the policy's [2B] sums and token counts; ref_logps: the
    reference's [2B] sums (None for simpo / orpo). pref: the recipe's preference block."""
    beta = pref["beta"]
    chosen, rejected = _halves(logps)
    n_c, n_r = (c.to(logps.dtype) for c in _halves(counts))
    if objective in ("dpo", "ipo"):
        ref_c, ref_r = _halves(ref_logps.to(logps.dtype))
        ratio_c, ratio_r = chosen - ref_c, rejected - ref_r
        if objective == "ipo":  # per-token averages (TRL's ipo)
            ratio_c, ratio_r = ratio_c / n_c, ratio_r / n_r
            losses = (ratio_c - ratio_r - 1 / (2 * beta)) ** 2
        else:
            losses = _sigmoid_loss(beta * (ratio_c - ratio_r), pref["label_smoothing"])
        reward_c, reward_r = beta * ratio_c.detach(), beta * ratio_r.detach()
        loss = losses.mean()
    elif objective == "simpo":  # CPO with loss_type simpo, cpo_alpha 0: reference-free, length-normalised
        avg_c, avg_r = chosen / n_c, rejected / n_r
        loss = _sigmoid_loss(beta * (avg_c - avg_r) - pref["gamma"], 0.0).mean()
        reward_c, reward_r = beta * avg_c.detach(), beta * avg_r.detach()
    elif objective == "orpo":  # NLL(chosen) - beta x mean log sigmoid(log odds ratio), on average log-probs
        avg_c, avg_r = chosen / n_c, rejected / n_r
        nll = -chosen.sum() / n_c.sum().clamp(min=1)  # cross-entropy over all chosen tokens (token mean, as TRL)
        log_odds = (avg_c - avg_r) - (torch.log1p(-torch.exp(avg_c)) - torch.log1p(-torch.exp(avg_r)))
        loss = nll - beta * F.logsigmoid(log_odds).mean()
        reward_c, reward_r = beta * avg_c.detach(), beta * avg_r.detach()
    else:
        raise ValueError(f"unknown preference objective {objective!r}")
    metrics = {"rewards_chosen": reward_c.mean(), "rewards_rejected": reward_r.mean(),
               "rewards_margin": (reward_c - reward_r).mean(), "rewards_accuracy": (reward_c > reward_r).float().mean(),
               "logps_chosen": chosen.detach().mean(), "logps_rejected": rejected.detach().mean()}
    return loss.float(), metrics

