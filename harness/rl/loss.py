"""The GRPO family's loss on one micro-batch of completions, as TRL 1.16's GRPOTrainer._compute_loss states it.

Per token (completion tokens up to and including the first EOS; a truncated completion's none under
mask_truncated_completions), with r = exp(logp - old_logp) (token level) or exp of the sequence's mean log-ratio
(importance_sampling_level sequence, GSPO) and A the completion's advantage:
    grpo bnpo dr_grpo dapo   -min(r' A, clip(r, 1 - epsilon, 1 + epsilon_high) A), r' = min(r, delta) if delta
    cispo                    -min(r, epsilon_high).detach() A logp
    sapo                     -sigmoid(tau (r - 1)) 4 / tau A, tau = sapo_temperature_pos if A > 0 else _neg
and + beta x k3 KL x r when beta > 0: k3 = exp(ref - logp) - (ref - logp) - 1 (use_bias_correction_kl).

Averaged (`reduce`): grpo / sapo per sequence then over sequences; bnpo over the micro-batch's tokens; dr_grpo over
B x max_completion_length; dapo / cispo over the step's completion tokens on all ranks and accumulation steps. The
engine divides a micro-batch's loss by the accumulation steps and averages gradients over ranks, so dapo's
micro-batch loss is its token sum x (ranks x accumulation steps) / the step's tokens: the update is the gradient of
the sum over the step's tokens / their count, however the batch is split.

The log-probs come from the logits divided by the sampling temperature, as TRL's.

The clip metrics are TRL's (per micro-batch; harness/rl/step_metrics.py reduces them over ranks and micro-batches):
grpo bnpo dr_grpo dapo log clip_ratio/low_mean, high_mean, region_mean (the fraction of the micro-batch's loss tokens
with r < 1 - epsilon and A < 0, r > 1 + epsilon_high and A > 0, either) and clip_ratio/low_min, high_max (the least
low / the most high clipped fraction of any one completion, over every rank's completions); cispo logs
cispo_clip_ratio (r > epsilon_high and A > 0); sapo none. Under GSPO each completion counts once.
"""

from __future__ import annotations

import torch

CLIP_STATS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
CLIP_EXTREMES = ("clip_ratio/low_min", "clip_ratio/high_max")  # over completions: see step_metrics.EXTREMES


def completion_logits(logits: torch.Tensor, prompt_len: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width, V]: the logits that predict completion token t of row b (at position prompt_len[b] - 1 + t of a
    row laid out prompt, completion, padding)."""
    idx = (prompt_len.to(logits.device).unsqueeze(1) - 1 + torch.arange(width, device=logits.device)).clamp(
        max=logits.shape[1] - 1)
    return logits.gather(1, idx.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))


def token_logps(logits: torch.Tensor, completion: torch.Tensor, temperature: float,
                entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-prob of each completion token [B, C] in float32 (float64 logits: float64), entropy [B, C] or None) from
    the completion's logits [B, C, V], divided by the temperature."""
    wide = torch.promote_types(logits.dtype, torch.float32)
    logp_all = torch.log_softmax(logits.to(wide) / temperature, dim=-1)
    logps = logp_all.gather(-1, completion.to(logits.device).unsqueeze(-1)).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1).detach() if entropy else None
    return logps, ent


def importance(logps: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """r: [B, C] per token, or [B, 1] per sequence (GSPO)."""
    log_ratio = logps - old
    if level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    return torch.exp(log_ratio)


def correction(logps, sampling, mask, rl: dict) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """rl.async: (old log-probs for per_token_loss, a weight per token or None, the ratio per token it used [B, C]).
    ppo_clip (TRL's AsyncGRPO): the clip and ratio against the sampler's log-probs, r = exp(logp - sampling_logp);
    tis (TRL's vllm_importance_sampling_mode token_truncate): the ratio to the policy's own log-probs (1 at
    num_iterations 1), the loss weighted by min(exp(logp - sampling_logp), vllm_importance_sampling_clip_max),
    detached."""
    if rl["async_correction"] == "ppo_clip":
        used = importance(logps.detach(), sampling, mask, rl["importance_sampling_level"])
        return sampling, None, used.expand_as(logps)
    weight = torch.exp(logps.detach() - sampling).clamp(max=rl["vllm_importance_sampling_clip_max"])
    return logps.detach(), weight, weight


def per_token_loss(logps, old, ref, adv, mask, rl: dict) -> tuple[torch.Tensor, dict, dict]:
    """([B, C] loss per token, {name: (sum, count)} of the clip ratios and the KL, {name: [B] per completion} of the
    clip fractions whose extremes over the ranks are logged)."""
    adv = adv.to(logps.dtype).unsqueeze(1)
    coef = importance(logps, old, mask, rl["importance_sampling_level"])
    eps_low, eps_high = rl["epsilon"], rl["epsilon"] if rl["epsilon_high"] is None else rl["epsilon_high"]
    loss_type, stats, per_seq = rl["loss_type"], {}, {}
    if loss_type == "cispo":
        loss = -torch.clamp(coef, max=eps_high).detach() * adv * logps
        stats["cispo_clip_ratio"] = _masked(((coef > eps_high) & (adv > 0)).float(), mask)
    elif loss_type == "sapo":
        tau = torch.where(adv > 0, rl["sapo_temperature_pos"], rl["sapo_temperature_neg"]).to(logps.dtype)
        loss = -torch.sigmoid(tau * (coef - 1)) * 4 / tau * adv
    else:
        clipped = torch.clamp(coef, 1 - eps_low, 1 + eps_high)
        free = coef if rl["delta"] is None else torch.clamp(coef, max=rl["delta"])
        loss = -torch.min(free * adv, clipped * adv)
        low, high = (coef < 1 - eps_low) & (adv < 0), (coef > 1 + eps_high) & (adv > 0)
        for name, hit in zip(CLIP_STATS, (low, high, low | high)):
            stats[name] = _masked(hit.float(), mask)
        for name, hit in zip(CLIP_EXTREMES, (low, high)):
            per_seq[name] = _seq_mean(hit.float(), mask)
    if rl["beta"] != 0:
        diff = ref.to(logps.dtype) - logps
        kl = (torch.exp(diff) - diff - 1) * coef
        stats["kl"] = _masked(kl.detach(), mask)
        loss = loss + rl["beta"] * kl
    return loss, stats, per_seq


def _masked(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum, count) for a mean over the step's tokens, or over its sequences for a [B, 1] value (GSPO)."""
    if x.shape[1] == 1:
        return x.sum().detach(), torch.tensor(float(x.shape[0]))
    return (x * mask).sum().detach(), mask.sum().detach().float()


def _seq_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B]: each completion's mean over its loss tokens (NaN for one without any: TRL's nanmin / nanmax skip it), or
    the value itself for a [B, 1] value (GSPO)."""
    if x.shape[1] == 1:
        return x.squeeze(1).detach()
    return ((x * mask).sum(-1) / mask.sum(-1)).detach()


def reduce(loss: torch.Tensor, mask: torch.Tensor, rl: dict, step_tokens: int, splits: int) -> torch.Tensor:
    """The micro-batch's loss as the engine takes it (it divides by the accumulation steps and averages the ranks).
    step_tokens: completion tokens carrying loss in the whole step (all ranks); splits: ranks x accumulation steps."""
    loss_type, masked = rl["loss_type"], loss * mask
    if loss_type in ("grpo", "sapo"):
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return masked.sum() / (loss.shape[0] * rl["max_completion_length"])
    return masked.sum() * splits / max(step_tokens, 1)  # dapo, cispo
