"""The step of a reward-model run (train.objective reward): a Bradley-Terry loss on the preference pair store.

The model is transformers' sequence-classification class with one label (harness/model/hf.py, head "reward"); it
scores a row at its last token that is not the pad (or EOS) id, so a stored pair (prompt + completion + EOS, padded)
and a scored completion (prompt + completion text, harness/rl/rewards/model.py) are read at the same token. A
micro-batch is B pairs as 2B rows, chosen first (harness/data/preference.py); per pair r_c - r_r, and

    loss = mean over pairs of -log sigmoid(r_c - r_r)          (TRL's RewardTrainer, margin and centring off)

Metrics, averaged like a preference run's: rewards_accuracy (the share with r_c > r_r, ties wrong), rewards_margin
(mean r_c - r_r), rewards_chosen and rewards_rejected (mean scores). DeepSpeed divides by the accumulation steps
and averages over ranks, so the update is the gradient of the mean over the step's pairs, as one process computes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from harness.train.preference import PreferenceSteps


def bradley_terry(scores: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """[2B] scores (chosen first) -> (loss, metrics)."""
    chosen, rejected = scores.float().chunk(2)
    margin = chosen - rejected
    seen = margin.detach()
    return -F.logsigmoid(margin).mean(), {
        "rewards_accuracy": (seen > 0).float().mean(), "rewards_margin": seen.mean(),
        "rewards_chosen": chosen.detach().mean(), "rewards_rejected": rejected.detach().mean()}


class RewardSteps(PreferenceSteps):
    """The preference step's train and eval loops (train/preference.py) over this loss."""

    def __init__(self, spec, reference=None):
        self.spec = spec

    def loss(self, engine, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, dict]:
        input_ids = batch[0].to(engine.device)
        scores = engine(input_ids=input_ids, use_cache=False).logits[:, 0]
        return bradley_terry(scores)
