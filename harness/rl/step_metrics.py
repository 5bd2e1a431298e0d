"""A GRPO step's loss metrics (clip ratios, KL, entropy) reduced as TRL 1.16's GRPOTrainer reduces them.

TRL computes them in each micro-batch's loss (_compute_loss) and averages the values of the logging window (log()):
  - a mean (`kl`, `entropy`, `clip_ratio/low_mean`, `high_mean`, `region_mean`, `cispo_clip_ratio`): the micro-batch's
    sum over its loss tokens (a completion, under GSPO) and their count, each summed over the ranks, divided
    (global_masked_mean; count clamped at 1);
  - an extreme (`clip_ratio/low_min`, `high_max`): each completion's clipped fraction, gathered from every rank, then
    the nanmin / nanmax (a completion without loss tokens gives NaN and is skipped);
  - the logged value: the mean over the step's micro-batches of those values, NaN skipped (None when none is left).
Here every rank keeps its micro-batches' values and ONE all-gather at the step's end (not one per micro-batch, as
TRL's) brings every rank's values to every rank, which then reduces exactly as above.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as tdist

EXTREMES = {"clip_ratio/low_min": torch.min, "clip_ratio/high_max": torch.max}


class StepMetrics:
    def __init__(self):
        self.means: list[dict] = []  # per micro-batch: {name: (sum, count)}
        self.per_seq: list[dict] = []  # per micro-batch: {name: [B] per completion}

    def add(self, means: dict, per_seq: dict) -> None:
        self.means.append({k: (s.detach().double().reshape(()), c.double().reshape(()))
                           for k, (s, c) in means.items()})
        self.per_seq.append({k: v.detach().double().reshape(-1) for k, v in per_seq.items()})

    def reduce(self) -> dict:
        """{name: value over the step} (collective: every rank calls it once per step, with the same names)."""
        if not self.means:
            return {}
        names, seq_names = sorted(self.means[0]), sorted(self.per_seq[0])
        rows = [torch.cat([torch.stack([m[k][i] for k in names for i in (0, 1)]).cpu()] +
                          [s[k].cpu() for k in seq_names]) for m, s in zip(self.means, self.per_seq)]
        local = torch.stack(rows)  # [micro-batches, 2 x names + completions x seq_names]
        every = _gather(local)  # [ranks, micro-batches, ...]
        out = {}
        for j, name in enumerate(names):
            sums, counts = every[:, :, 2 * j].sum(0), every[:, :, 2 * j + 1].sum(0)
            out[name] = _nanmean(sums / counts.clamp(min=1.0))
        width = (local.shape[1] - 2 * len(names)) // max(len(seq_names), 1)
        for j, name in enumerate(seq_names):
            lo = 2 * len(names) + j * width
            values = every[:, :, lo:lo + width].transpose(0, 1).reshape(local.shape[0], -1)
            out[name] = _nanmean(torch.stack([_nan_extreme(EXTREMES[name], v) for v in values]))
        return out


def _gather(local: torch.Tensor) -> torch.Tensor:
    if not tdist.is_initialized() or tdist.get_world_size() == 1:
        return local.unsqueeze(0)
    device = torch.device("cuda", torch.cuda.current_device()) if tdist.get_backend() == "nccl" else "cpu"
    parts = [torch.empty_like(local, device=device) for _ in range(tdist.get_world_size())]
    tdist.all_gather(parts, local.to(device))
    return torch.stack(parts).cpu()


def _nan_extreme(fn, values: torch.Tensor) -> torch.Tensor:
    kept = values[~torch.isnan(values)]
    return fn(kept) if kept.numel() else torch.tensor(math.nan, dtype=values.dtype)


def _nanmean(values: torch.Tensor) -> float | None:
    kept = values[~torch.isnan(values)]
    return float(kept.mean()) if kept.numel() else None
