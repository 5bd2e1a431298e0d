"""The step of a preference run (train.objective dpo, ipo, simpo, orpo) on ddp and ZeRO-0..3, offload and LoRA.

A micro-batch is B pairs as 2B rows (chosen first, then rejected: harness/data/preference.py) and the ids of its
pairs. Per micro-batch: the reference's log-probs (train/reference.py; none for simpo / orpo), one forward of the
policy over the 2B rows, the loss of this rank's pairs (train/objectives.py), engine.backward and engine.step.
DeepSpeed divides each micro-batch's loss by the accumulation steps itself and averages the gradients over the
data-parallel ranks, so the update is the gradient of the mean over the step's micro-batches and ranks, as a
one-process loop over the same micro-batches computes it. The logged loss and metrics are this rank's means over
its micro-batches; the trainer's flush averages them over ranks.
"""

from __future__ import annotations

import torch

from harness.train.objectives import label_logps, preference_loss


class PreferenceSteps:
    def __init__(self, spec, reference):
        self.objective = spec.recipe["train"]["objective"]
        self.pref = spec.recipe["preference"]
        self.reference = reference  # train/reference.Reference; None for simpo / orpo

    def loss(self, engine, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, dict]:
        input_ids, labels, ids = batch
        ref = self.reference.logps(engine, input_ids, labels, ids) if self.reference is not None else None
        logits = engine(input_ids=input_ids.to(engine.device), use_cache=False).logits
        logps, counts = label_logps(logits, labels)
        return preference_loss(self.objective, self.pref, logps, counts.to(logps.device), ref)

    def train(self, engine, batches: list) -> tuple[torch.Tensor, dict]:
        """One optimizer step over this rank's micro-batches: (mean loss, {metric: mean}) as device tensors."""
        total = None
        for batch in batches:
            loss, metrics = self.loss(engine, batch)
            engine.backward(loss)
            engine.step()
            total = _add(total, {"loss": loss.detach().float(), **metrics})
        return _means(total, len(batches))

    @torch.no_grad()
    def eval(self, engine, batches: list) -> tuple[torch.Tensor, dict]:
        total = None
        for batch in batches:
            loss, metrics = self.loss(engine, batch)
            total = _add(total, {"loss": loss.float(), **metrics})
        return _means(total, len(batches))


def _add(total: dict | None, values: dict) -> dict:
    return dict(values) if total is None else {k: total[k] + values[k] for k in total}


def _means(total: dict, n: int) -> tuple[torch.Tensor, dict]:
    means = {k: v / n for k, v in total.items()}
    return means.pop("loss"), means
