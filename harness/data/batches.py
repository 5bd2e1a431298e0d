"""Which packed rows every rank trains on at every optimizer step.

Loss parity and exact resume depend on this being a pure function of the step: a single-process run with
global batch G and a run on dp_size ranks (each taking its slice of the same G rows) see the same rows in
the same step, and a run resumed at step k needs nothing but k to continue where it stopped.

Epoch e visits the rows in the order torch.randperm(num_rows, seed + e); each epoch yields
floor(num_rows / global_batch) global batches (the tail is dropped, so every step is full).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache


@lru_cache(maxsize=4)
def _epoch_order(num_rows: int, epoch_seed: int):
    """Row order of one epoch; cached because consecutive steps share it (callers must not mutate it)."""
    import torch

    return torch.randperm(num_rows, generator=torch.Generator().manual_seed(epoch_seed))


def check_shape(plan) -> None:
    """The batch arithmetic every plan (BatchPlan, MixPlan, StreamPlan) must satisfy."""
    per_step = plan.micro_batch * plan.grad_accum * plan.dp_size
    if min(plan.micro_batch, plan.grad_accum, plan.dp_size) < 1:
        raise ValueError(f"micro_batch ({plan.micro_batch}), grad_accum ({plan.grad_accum}) and dp_size "
                         f"({plan.dp_size}) must all be >= 1")
    if plan.global_batch != per_step:
        raise ValueError(f"global_batch ({plan.global_batch}) != micro_batch ({plan.micro_batch}) * "
                         f"grad_accum ({plan.grad_accum}) * dp_size ({plan.dp_size}) = {per_step}")
    if not 0 <= plan.dp_rank < plan.dp_size:
        raise ValueError(f"dp_rank ({plan.dp_rank}) must be in [0, dp_size={plan.dp_size})")


@dataclass(frozen=True)
class BatchPlan:
    num_rows: int  # packed rows (blocks of seq_len tokens) in the training split
    global_batch: int  # rows per optimizer step over all DP ranks = micro_batch * grad_accum * dp_size
    micro_batch: int  # rows per forward/backward on one rank
    grad_accum: int  # micro-batches per optimizer step on one rank
    dp_rank: int = 0
    dp_size: int = 1
    seed: int = 0  # epoch e shuffles with seed + e

    def __post_init__(self):
        check_shape(self)
        if self.num_rows < self.global_batch:
            raise ValueError(f"only {self.num_rows} rows of data for a global batch of {self.global_batch} rows: "
                             "not one full step; use more data, a smaller batch or a shorter seq_len")

    @property
    def steps_per_epoch(self) -> int:
        return self.num_rows // self.global_batch

    def epoch_of(self, step: int) -> int:
        """The epoch (0-based) optimizer step `step` (0-based) belongs to."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return step // self.steps_per_epoch

    def global_rows(self, step: int):
        """The global_batch row indices of optimizer step `step`, over all ranks, in rank order."""
        epoch = self.epoch_of(step)
        start = (step % self.steps_per_epoch) * self.global_batch
        return _epoch_order(self.num_rows, self.seed + epoch)[start:start + self.global_batch].clone()

    def micro_batches(self, step: int) -> list:
        """This rank's rows of step `step`: its contiguous slice of global_rows, in grad_accum chunks."""
        per_rank = self.micro_batch * self.grad_accum
        mine = self.global_rows(step)[self.dp_rank * per_rank:(self.dp_rank + 1) * per_rank]
        return list(mine.split(self.micro_batch))
