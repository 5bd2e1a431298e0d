"""Rewards -> advantages, as TRL 1.16's GRPOTrainer (multi_objective_aggregation sum_then_normalize) computes them.

The reward of a completion is the nansum over functions of weight x score (None, "not applicable", is NaN); a
completion no function scored is NaN: it is left out of its group's mean and std and its advantage is 0.
advantage = reward - group mean, divided by (std + 1e-4) where the std is Bessel-corrected over the group
(scale_rewards group), over the whole batch (batch) or not used (none). A group of equal rewards has std 0
(`frac_reward_zero_std`), hence advantage 0. Computed in float32, as TRL does on its device.
"""

from __future__ import annotations

import torch

STD_EPS = 1e-4  # TRL's (std + 1e-4)


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Bessel-corrected std ignoring NaNs (trl.trainer.utils.nanstd)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(x), dim=dim, keepdim=True)
    var = var * count / (count - 1)
    return torch.sqrt(var).squeeze() if dim is None else torch.sqrt(var).squeeze(dim)


def total_rewards(per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[N, F] scores (NaN: not applicable) -> [N] rewards; NaN where no function applied."""
    rewards = (per_func * weights.unsqueeze(0)).nansum(dim=1)
    rewards[torch.isnan(per_func).all(dim=1)] = torch.nan
    return rewards


def advantages(rewards: torch.Tensor, num_generations: int, scale: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages [N], is_std_zero [N]) from [N] rewards in groups of num_generations consecutive completions."""
    groups = rewards.view(-1, num_generations)
    mean = torch.nanmean(groups, dim=1).repeat_interleave(num_generations)
    if scale == "batch":
        std = nanstd(rewards).expand_as(rewards)
    else:  # group, and none (whose std only feeds frac_reward_zero_std)
        std = nanstd(groups, dim=1).repeat_interleave(num_generations)
    adv = rewards - mean
    if scale != "none":
        adv = adv / (std + STD_EPS)
    return torch.nan_to_num(adv, nan=0.0), torch.isclose(std, torch.zeros_like(std))


def reward_metrics(per_func: torch.Tensor, weights: torch.Tensor, names: tuple[str, ...],
                   is_std_zero: torch.Tensor) -> dict:
    """TRL's names: rewards/NAME/mean and /std per function (over the completions it applied to), reward,
    reward_std, frac_reward_zero_std."""
    out = {}
    for i, name in enumerate(names):
        out[f"rewards/{name}/mean"] = torch.nanmean(per_func[:, i]).item()
        out[f"rewards/{name}/std"] = nanstd(per_func[:, i]).item()
    rewards = total_rewards(per_func, weights)
    out.update({"reward": torch.nanmean(rewards).item(), "reward_std": nanstd(rewards).item(),
                "frac_reward_zero_std": is_std_zero.float().mean().item()})
    return out
