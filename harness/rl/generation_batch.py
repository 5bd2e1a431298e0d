"""One generation of a step, as records (the lines of rollouts.jsonl): every rank holds the step's records, computes
the advantages from the step's rewards (all of them: a group may span ranks) and takes its contiguous slice as its
Rollouts. The same path serves a live generation (records gathered from the ranks), a replay file (rl.replay) and
a resumed run in the middle of num_iterations (the generation kept in the checkpoint).
"""

from __future__ import annotations

import math

import torch

from harness.rl.advantages import advantages, nanstd, reward_metrics
from harness.rl.rollouts import Rollouts, kept_ids, loss_mask, truncated


def _nan(v) -> float:
    return float("nan") if v is None else float(v)


def fill_advantages(records: list[dict], rl: dict, names: tuple[str, ...], weights: tuple[float, ...]) -> dict:
    """Give every record its advantage (a recorded one is kept as recorded) and return the reward metrics."""
    g = rl["num_generations"]
    if names and all("rewards" in r for r in records):
        per_func = torch.tensor([[_nan(r["rewards"].get(n)) for n in names] for r in records], dtype=torch.float32)
        rewards = (per_func * torch.tensor(weights).unsqueeze(0)).nansum(dim=1)
        rewards[torch.isnan(per_func).all(dim=1)] = torch.nan
    else:
        per_func = None
        rewards = torch.tensor([_nan(r.get("reward")) for r in records], dtype=torch.float32)
    adv, zero_std = advantages(rewards, g, rl["scale_rewards"])
    for r, a, total in zip(records, adv.tolist(), rewards.tolist()):
        r.setdefault("advantage", a)
        r.setdefault("reward", None if math.isnan(total) else total)
    if per_func is not None:
        return reward_metrics(per_func, torch.tensor(weights), names, zero_std)
    known = rewards[~torch.isnan(rewards)]
    if known.numel() == 0:  # a replay file with advantages only
        return {}
    return {"reward": known.mean().item(), "reward_std": nanstd(rewards).item(),
            "frac_reward_zero_std": zero_std.float().mean().item()}


def completion_metrics(records: list[dict], eos_ids: tuple[int, ...]) -> dict:
    """TRL's completions/* over the step's completions: lengths up to and including the first EOS (multi-turn: the
    sampled tokens only, tool tokens left out, as TRL's), the share cut at max_completion_length (no EOS), and the
    lengths of those that ended; step_tokens: the prompt and completion tokens the step's forwards take (what
    tokens_per_s counts). Multi-turn steps add TRL's tools/call_frequency (calls per completion) and
    tools/failure_frequency (failed calls per call), and tools/timeouts (rows ended by rl.tool_timeout_s)."""
    lengths, ended, fed = [], [], 0
    for r in records:
        mask = r.get("tool_mask")
        kept = kept_ids(r["completion_ids"], eos_ids, mask)
        lengths.append(sum(loss_mask(kept, mask)))
        fed += len(kept)
        if not truncated(r["completion_ids"], eos_ids, mask):
            ended.append(lengths[-1])
    tokens = fed + sum(len(r["prompt_ids"]) for r in records)
    out = {"step_tokens": float(tokens), "completions/mean_length": sum(lengths) / len(lengths),
           "completions/min_length": float(min(lengths)),
           "completions/max_length": float(max(lengths)),
           "completions/clipped_ratio": 1 - len(ended) / len(lengths)}
    if ended:
        out.update({"completions/mean_terminated_length": sum(ended) / len(ended),
                    "completions/min_terminated_length": float(min(ended)),
                    "completions/max_terminated_length": float(max(ended))})
    if any("tool_calls" in r for r in records):
        calls, failed = sum(r.get("tool_calls", 0) for r in records), sum(r.get("tool_failures", 0) for r in records)
        out.update({"tools/call_frequency": calls / len(records), "tools/failure_frequency": failed / calls if calls
                    else 0.0, "tools/timeouts": float(sum(r.get("finish") == "error" for r in records))})
    return out


def local_rollouts(records: list[dict], rank: int, per_rank: int, eos_ids: tuple[int, ...],
                   sampling: bool = False) -> Rollouts:
    """This rank's slice of the step's records as Rollouts (old_logps as recorded, when every record has them;
    sampling: the generator's sampling_logps too, rl.async)."""
    mine = records[rank * per_rank:(rank + 1) * per_rank]
    old = None
    if all(r.get("old_logps") is not None for r in mine):
        old = [torch.tensor(r["old_logps"], dtype=torch.float32) for r in mine]
    masks = [r.get("tool_mask") for r in mine] if any(r.get("tool_mask") is not None for r in mine) else None
    sampled = [torch.tensor(r["sampling_logps"], dtype=torch.float32) for r in mine] if sampling else None
    return Rollouts([list(r["prompt_ids"]) for r in mine], [list(r["completion_ids"]) for r in mine],
                    torch.tensor([float(r["advantage"]) for r in mine], dtype=torch.float32), eos_ids, old_logps=old,
                    tool_masks=masks, sampling_logps=sampled)


def step_loss_tokens(records: list[dict], eos_ids: tuple[int, ...], mask_truncated: bool) -> int:
    """Completion tokens carrying loss in the whole step (dapo / cispo's denominator; tool tokens carry none)."""
    total = 0
    for r in records:
        mask = r.get("tool_mask")
        if mask_truncated and truncated(r["completion_ids"], eos_ids, mask):
            continue
        total += sum(loss_mask(kept_ids(r["completion_ids"], eos_ids, mask), mask))
    return total
