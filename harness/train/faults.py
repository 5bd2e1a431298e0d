"""Numeric faults: a non-finite loss or gradient, or a loss spike, on any rank, agreed on by every rank in the step.

When the check is on (train.on_nonfinite stop | skip | rollback; `off` keeps only the late check at each log
flush), the Guard wraps two engine calls:
  - engine.backward(loss): keeps each micro-batch's loss (detached, on the device) for the check;
  - engine.optimizer.step(), which the engine calls once per optimizer step, at the accumulation boundary, after
    the gradients were reduced. Before the update, each rank sets its flag (a non-finite micro-batch loss, or a
    non-finite element in its reduced gradients: non-finite elements are what make the global norm non-finite),
    and ONE all-reduce (sum) of [loss flag of each rank, gradient flag of each rank, loss sum, ranks with a loss]
    tells every rank which ranks saw a fault and the step's mean loss; the host reads it (the one sync per step).
    A NaN loss on one rank spreads to every rank's reduced gradients, so the ranks named are those with a
    non-finite loss when there are any, else those with non-finite gradients. A faulty
    step, or a spike (train.spike > 0: the mean loss above spike x the running median of the last
    train.spike_window kept steps), is dropped through the optimizer's own overflow path (fault_gate.py):
    parameters and optimizer state stay as they were and the LR scheduler does not advance.
A pipeline's loss is read from its last stage (PipelineEngine.total_loss); the other stages flag their gradients.
Under fp16 the gradients are not judged (the loss scaler's overflows are DeepSpeed's to skip), only the loss.

Then the trainer applies the policy (Policy): stop (exit EXIT_NUMERIC_FAULT with the step, the ranks and the
batch's rows and documents; nothing is saved after the fault, so `latest` names the checkpoint before it), skip
(the step counts as done, its batch is consumed; stop after train.nonfinite_limit in a row), rollback (reload
`latest` in this process and go on without the offending batch: DataSteps maps training steps to data batches,
and is saved in every checkpoint so a resume keeps the mapping; stop after train.nonfinite_limit rollbacks
without getting past the fault).

Test hook: DSHARNESS_INJECT_LOSS="BATCH:RANK:FACTOR[,...]" (read once per run, used only when the check is on)
multiplies the loss that rank passes to backward by FACTOR (nan, inf or a number; `grad`: the loss unchanged, its
gradient NaN) on every micro-batch of data batch BATCH (0-based): the fault enters one rank's gradients and spreads
to the others by DeepSpeed's reduction, as a bad batch would. Unset in every real run.
"""

from __future__ import annotations

import os
import statistics
import time
from collections import deque
from dataclasses import dataclass

import torch

from harness.errors import Problem
from harness.train import fault_gate
from harness.train.preempt import EXIT_NUMERIC_FAULT  # noqa: F401 (the trainer's exit code; defined there)

INJECT_ENV = "DSHARNESS_INJECT_LOSS"
CLIENT_KEY = "skipped_batches"  # in the checkpoint's client state: data batches rollbacks stepped over


class NumericFault(Exception):
    """The run stops on a numeric fault (train.on_nonfinite stop, or a limit reached). Exit EXIT_NUMERIC_FAULT."""


@dataclass(frozen=True)
class Verdict:
    reason: str  # "nonfinite" | "spike"
    seen: str  # "loss" | "gradients" | "spike": a non-finite loss is named before the gradients it spread to
    ranks: tuple[int, ...]  # the ranks that saw it (all ranks for a spike: it is the mean's)
    loss: float  # the step's mean loss over the ranks (nan when one was not finite)
    median: float | None  # the spike rule's running median, when it judged


def recipe_problems(recipe: dict) -> list[Problem]:
    train = recipe["train"]
    spike = float(train.get("spike", 0))
    if spike and train.get("on_nonfinite") == "off":
        return [Problem("train.spike", f"the spike rule ({spike:g}) judges each step's loss, which only the per-step "
                        "check reads; train.on_nonfinite is off", "train.on_nonfinite=stop|skip|rollback, or "
                        "train.spike=0")]
    if 0 < spike <= 1:
        return [Problem("train.spike", f"{spike:g} would call half of all steps a spike (the factor multiplies the "
                        "running median of the losses)", "a factor above 1 (e.g. 3), or 0 to turn the rule off")]
    return []


def parse_injection(text: str | None) -> dict[tuple[int, int], float | str]:
    """DSHARNESS_INJECT_LOSS -> {(batch, rank): factor, or "grad"}."""
    out = {}
    for item in filter(None, (text or "").split(",")):
        batch, rank, factor = item.strip().split(":")
        out[(int(batch), int(rank))] = factor if factor == "grad" else float(factor)
    return out


class _PoisonGrad(torch.autograd.Function):
    """The injection's "grad": the loss unchanged, its gradient NaN (a finite loss whose backward overflows)."""

    @staticmethod
    def forward(ctx, loss):
        return loss.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


class SpikeRule:
    """A step's loss is a spike when it exceeds factor x the median of the last `window` kept losses; it judges
    only once the window is full. 0: off."""

    def __init__(self, factor: float, window: int):
        self.factor, self.recent = factor, deque(maxlen=window)

    def judge(self, loss: float) -> float | None:
        """The median the loss is a spike over, or None (no spike, or not judged)."""
        if not self.factor or len(self.recent) < self.recent.maxlen:
            return None
        median = statistics.median(self.recent)
        return median if loss > self.factor * median else None

    def keep(self, loss: float) -> None:
        if self.factor:
            self.recent.append(loss)


class DataSteps:
    """Training step -> data batch: the identity, except for batches a rollback stepped over."""

    def __init__(self, skipped=()):
        self.skipped = sorted(set(int(s) for s in skipped))

    def batch(self, step: int) -> int:
        for s in self.skipped:
            if s <= step:
                step += 1
        return step


class Guard:
    """The per-step check (see the module docstring); one per run, built by `Guard.of`."""

    def __init__(self, engine, train: dict, rank: int, world: int):
        self.engine, self.rank, self.world = engine, rank, world
        # fp16's dynamic loss scale overflows the gradients on purpose now and then; DeepSpeed skips those steps and
        # lowers the scale itself, so under fp16 only the loss is judged
        self.check_grads = not engine.fp16_enabled()
        self.spike = SpikeRule(float(train["spike"]), int(train["spike_window"]))
        self.inject = parse_injection(os.environ.get(INJECT_ENV))
        self.losses: list[torch.Tensor] = []
        self.batch, self._verdict = -1, None
        self.spent_s, self.local_s, self.checked = 0.0, 0.0, 0  # the check's time (all; the flags alone), count
        self._backward, self._step = engine.backward, engine.optimizer.step
        engine.backward = self._on_backward
        engine.optimizer.step = self._on_step

    @classmethod
    def of(cls, engine, train: dict, rank: int, world: int) -> "Guard | None":
        return None if train["on_nonfinite"] == "off" else cls(engine, train, rank, world)

    def begin(self, batch: int) -> None:
        """Before a step's first forward: the data batch it trains on."""
        self.batch, self.losses, self._verdict = batch, [], None

    def cost_ms(self) -> dict:
        """Mean milliseconds per step the check took: all of it (on CUDA including the wait for the step's queued
        work; with the other ranks' lag the all-reduce waits for), and the local flags alone (on CPU)."""
        if not self.checked:
            return {}
        return {"nonfinite_check_ms": round(1000 * self.spent_s / self.checked, 3),
                "nonfinite_check_local_ms": round(1000 * self.local_s / self.checked, 3)}

    def verdict(self) -> Verdict | None:
        """After the step: why it was dropped, or None when it was kept."""
        return self._verdict

    def _on_backward(self, loss, *args, **kwargs):
        factor = self.inject.get((self.batch, self.rank))
        if factor is not None:
            loss = _PoisonGrad.apply(loss) if factor == "grad" else loss * factor
        self.losses.append(loss.detach().float())
        return self._backward(loss, *args, **kwargs)

    def _own_loss(self) -> torch.Tensor | None:
        if self.losses:
            return torch.stack(self.losses).mean()
        total = getattr(self.engine, "total_loss", None)  # a pipeline's last stage (sum over its micro-batches)
        if not torch.is_tensor(total):
            return None
        return total.detach().float().reshape(-1)[0] / self.engine.gradient_accumulation_steps()

    def _on_step(self, *args, **kwargs):
        import torch.distributed as dist

        start, device, world = time.perf_counter(), self.engine.device, self.world
        loss = self._own_loss()
        votes = torch.zeros(2 * world + 2, dtype=torch.float64, device=device)
        if self.check_grads:
            votes[world + self.rank] = fault_gate.nonfinite(fault_gate.local_grads(self.engine), device)
        if loss is not None:
            votes[self.rank] = (~torch.isfinite(loss)).double()
            votes[2 * world], votes[2 * world + 1] = loss.double(), 1.0
        local = time.perf_counter()  # on CUDA only the queuing: the kernels finish in the host read below
        if dist.is_initialized() and world > 1:
            dist.all_reduce(votes)
        votes = votes.cpu().tolist()  # the host waits for the step here: the one sync the check costs
        bad_loss = tuple(r for r in range(world) if votes[r] > 0)
        bad_grads = tuple(r for r in range(world) if votes[world + r] > 0)
        mean = votes[2 * world] / votes[2 * world + 1] if votes[2 * world + 1] else float("nan")
        median = None if bad_loss or bad_grads else self.spike.judge(mean)
        self.spent_s, self.local_s = self.spent_s + time.perf_counter() - start, self.local_s + local - start
        self.checked += 1
        if bad_loss or bad_grads or median is not None:
            seen = "loss" if bad_loss else "gradients" if bad_grads else "spike"
            self._verdict = Verdict("spike" if seen == "spike" else "nonfinite", seen,
                                    bad_loss or bad_grads or tuple(range(world)), mean, median)
            return fault_gate.drop_update(self.engine.optimizer, lambda: self._step(*args, **kwargs))
        self.spike.keep(mean)
        return fault_gate.plain_step(self.engine.optimizer, lambda: self._step(*args, **kwargs))


class Policy:
    """What a dropped step leads to: stop, skip or rollback, and the limits (train.nonfinite_limit)."""

    def __init__(self, train: dict):
        self.mode, self.limit = train["on_nonfinite"], int(train["nonfinite_limit"])
        self.in_row = 0  # skip: faulty steps in a row
        self.rollbacks, self.fault_step = 0, -1  # rollback: rollbacks since a step past the last fault was kept

    def action(self, step: int) -> tuple[str, str | None]:
        """(stop | skip | rollback, why the run stops or None) for a fault at training step `step`."""
        if self.mode == "skip":
            self.in_row += 1
            if self.in_row >= self.limit:
                return "stop", f"{self.in_row} faulty steps in a row (train.nonfinite_limit {self.limit})"
            return "skip", None
        if self.mode == "rollback":
            self.rollbacks += 1
            self.fault_step = max(self.fault_step, step)
            if self.rollbacks > self.limit:
                return "stop", (f"{self.limit} rollbacks without getting past step {self.fault_step + 1} "
                                f"(train.nonfinite_limit {self.limit})")
            return "rollback", None
        return "stop", "train.on_nonfinite is stop"

    def kept(self, step: int) -> None:
        self.in_row = 0
        if step >= self.fault_step:  # the faulty step's index trained (on the next batch) and kept: progress
            self.rollbacks = 0


def rows_named(rows, limit: int = 16) -> str:
    """The store rows of `rows` (harness/data/rows.Rows) and, under document packing, the documents they hold (a
    mixture's per source); for preference pairs (harness/data/preference.Pairs) the pairs and the dataset records they came from."""
    import numpy as np

    from harness.data.mix_rows import MixRows
    from harness.data.preference import Pairs
    from harness.data.vision_store import VisionRows

    if isinstance(rows, MixRows):  # a mixture: each source's rows, named as its own store's
        ids = rows.source_ids()
        return "; ".join(f"source {rows.names[s]}: " + rows_named(rows.parts[s][rows.index[ids == s] - rows.offsets[s]],
                                                                  limit) for s in sorted(set(ids.tolist())))
    index = [int(i) for i in rows.index]
    if isinstance(rows, Pairs):
        return f"pairs {_few(index, limit)}, dataset records {_few(sorted({int(r) for r in rows.records}), limit)}"
    if isinstance(rows, VisionRows):  # packed conversations: the records they came from
        return f"store rows {_few(index, limit)}, records {_few(sorted({int(r) for r in rows.records}), limit)}"
    text = f"store rows {_few(index, limit)}"
    if rows.doc_ends is not None:
        seq = rows.tokens.shape[1]
        docs = sorted({d for r in index for d in range(int(np.searchsorted(rows.doc_ends, r * seq, side="right")),
                                                        int(np.searchsorted(rows.doc_ends, (r + 1) * seq - 1,
                                                                            side="right")) + 1)})
        text += f", documents {_few(docs, limit)}"
    return text


def _few(values: list[int], limit: int) -> str:
    return "[" + ", ".join(map(str, values[:limit])) + (f", ... {len(values) - limit} more" if len(values) > limit
                                                          else "") + "]"


FIX = ("look at those rows and documents (pairs and records), or lower optimizer.lr; train.on_nonfinite=skip "
       "drops such steps, rollback reloads `latest` and steps over the batch (docs/troubleshooting.md#numeric-faults)")


def _num(x: float | None):
    return None if x is None else (x if x == x and abs(x) != float("inf") else str(x))


def record(verdict: Verdict, batch: int, action: str, rows: dict[int, str]) -> dict:
    """The `fault` record's fields in metrics.jsonl (its step: the training step that was dropped, 1-based)."""
    return {"reason": verdict.reason, "seen": verdict.seen, "ranks": list(verdict.ranks), "batch": batch,
            "loss": _num(verdict.loss), "median": _num(verdict.median), "action": action,
            "rows": {str(r): t for r, t in rows.items()}}


def describe(verdict: Verdict, done: int, batch: int, rows: dict[int, str], train: dict) -> str:
    """One line: what was seen at which step on which ranks, and the rows of the batch there."""
    where = "; ".join(f"rank {r}: {t}" for r, t in rows.items())
    if verdict.reason == "spike":
        what = (f"loss spike: mean loss {verdict.loss:.4g} > train.spike {float(train['spike']):g} x the median "
                f"{verdict.median:.4g} of the last {train['spike_window']} steps")
    else:
        what = f"non-finite {verdict.seen} on rank{'s' if len(verdict.ranks) > 1 else ''} " + \
               ", ".join(map(str, verdict.ranks))
    return f"numeric fault at step {done} (data batch {batch}): {what} ({where})"
