"""The step of a distillation run (train.objective gkd, distill) on ddp and ZeRO-0..3, offload and LoRA.

A micro-batch is B prompt-completion rows (harness/train/distill_data.py); under lmbda > 0 (distill: always) rows
get the student's own completions first, with seq_kd the others the teacher's (harness/train/distill_policy.py);
rank 0 appends the step's generated completions to RUN/rollouts.jsonl (harness/rl/rollouts.py). Per optimizer step:
  1. the step's loss tokens (labels != -100 after the causal shift) are counted on the host over this rank's
     micro-batches and summed over the ranks in ONE all-reduce: N;
  2. per micro-batch: the teacher's targets at those tokens (harness/train/teacher.py), one forward of the student,
     the loss SUM over its tokens (harness/train/distill_loss.py) times dp x gas / N, engine.backward, engine.step.
DeepSpeed divides each micro-batch's loss by gas and averages the gradients over the dp ranks, so the update is the
gradient of (sum over every token of the step) / N: the same on every layout and accumulation as one process over the
same rows (TRL's num_items_in_batch, trl#4719). The logged loss is that value (the trainer averages the ranks' shares).

Metrics under TRL's names: entropy (the student's, at the loss temperature, mean over the step's loss tokens),
num_tokens (input tokens of the step, all ranks: TRL logs the running total), and teacher_entropy, time/teacher_s,
time/train_s (this rank's seconds in the teacher's forwards, and in the rest of the step).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.distributed as tdist

from harness.config.distill_rules import on_policy, settings
from harness.data.rows import IGNORE_INDEX
from harness.rl import rollouts
from harness.train.distill_loss import LOSSES


def loss_positions(labels: torch.Tensor) -> torch.Tensor:
    """[B, L - 1] bool: the positions whose logits predict a target (the token at t + 1 carries loss)."""
    return labels[:, 1:] != IGNORE_INDEX


def input_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Each row's length up to its last target: the prompt and the completion (the completion ends the row)."""
    where = torch.arange(1, labels.shape[1] + 1)
    return ((labels != IGNORE_INDEX) * where).amax(-1)


# A micro-batch: input_ids, labels, prompt lengths (Completions.tensors()), the record numbers (the trainer's fetch
# appends Completions.ids: the precomputed teacher's keys), and on-policy the rows the student completed.
RECORDS, GENERATED = 3, 4


def ce_labels(batch: tuple[torch.Tensor, ...], where: torch.Tensor) -> torch.Tensor:
    """[N] the loss tokens' ids for the CE term; -1 in the rows whose completion the student generated (the batch's
    GENERATED tensor, harness/train/distill_policy.py): the CE is on the dataset's completions only."""
    out = batch[1][:, 1:][where]
    if len(batch) > GENERATED:
        out = out.masked_fill(batch[GENERATED][where.nonzero()[:, 0]], -1)
    return out


def disable_dropout(module) -> None:
    """TRL's disable_dropout_in_model: every torch.nn.Dropout's p set to 0."""
    for m in module.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0


def _sum_over_ranks(values: list[float], device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if tdist.is_initialized() and tdist.get_world_size() > 1:
        tdist.all_reduce(t)
    return t.tolist()


class DistillSteps:
    def __init__(self, spec, teacher, run_dir: Path | None = None):
        """run_dir: where the training steps' completions go (rollouts.jsonl); None (an evaluation's): nowhere."""
        self.spec, self.cfg, self.teacher, self.run_dir = spec, settings(spec.recipe), teacher, run_dir
        self.dp, self.gas = spec.dp, spec.run.batch.grad_accum  # tp / pp / sp are refused (config/distill_rules.py)
        self.dropout_off = not self.cfg["disable_dropout"]
        self.generates = on_policy(spec.recipe)  # lmbda > 0, seq_kd, objective distill
        self.seq_kd = bool(self.cfg["seq_kd"]) and spec.recipe["train"]["objective"] == "gkd"
        self.first_step = True  # this launch's first: a resume's rollouts.jsonl loses the lines after it
        self.on_policy = None  # the generated completions (harness/train/distill_policy.py), made at step 1

    def completions(self, engine, batches: list, times: dict) -> tuple[list, list[dict]]:
        """(the micro-batches with their drawn rows' completions generated, a record per generated row)."""
        if not self.generates:
            return batches, []
        from harness.train.distill_policy import OnPolicy

        began = time.perf_counter()
        if self.on_policy is None:
            self.on_policy = OnPolicy(self.spec, engine, self.teacher)
        rank = tdist.get_rank() if tdist.is_initialized() else 0
        first = rank * sum(b[0].shape[0] for b in batches)  # the rank's slice of the step's rows (BatchPlan)
        out, made = [], []
        for batch in batches:  # engine.global_steps: the optimizer steps done, restored by a resume
            batch, records = self.on_policy.batch(engine.global_steps, first, batch)
            out.append(batch)
            made += records
            first += batch[0].shape[0]
        times["generate_s"] = time.perf_counter() - began
        return out, made

    def record(self, step: int, made: list[dict]) -> None:
        """RUN/rollouts.jsonl: the step's generated completions from every rank, in the step's row order, appended by
        rank 0 (one all-gather); at the run's first step the lines of later steps (a resume's) are dropped first."""
        if self.run_dir is None or not self.generates:
            return
        every = [made]
        if tdist.is_initialized() and tdist.get_world_size() > 1:
            every = [None] * tdist.get_world_size()
            tdist.all_gather_object(every, made)
        if tdist.is_initialized() and tdist.get_rank() != 0:
            return
        if self.first_step:
            rollouts.truncate_after(self.run_dir, step - 1)
            self.first_step = False
        rows = sorted((r for part in every for r in part), key=lambda r: r["row"])
        rollouts.append(self.run_dir, [json.dumps({"step": step, **r}) for r in rows])

    def loss_sums(self, engine, batch: tuple[torch.Tensor, ...], times: dict) -> tuple[torch.Tensor, ...]:
        """(loss sum, student entropy sum, teacher entropy sum) of one micro-batch."""
        input_ids, labels = batch[:2]
        where = loss_positions(labels)
        began = time.perf_counter()
        targets = self.teacher.targets(engine, input_ids, where, *batch[RECORDS:RECORDS + 1])
        times["teacher_s"] += time.perf_counter() - began
        logits = engine(input_ids=input_ids.to(engine.device), use_cache=False).logits
        student = logits[:, :-1][where.to(logits.device)]
        return LOSSES[targets.kind](student, targets, ce_labels(batch, where), self.cfg)

    def train(self, engine, batches: list) -> tuple[torch.Tensor, dict]:
        """One optimizer step over this rank's micro-batches: (this rank's share of the step's loss, metrics)."""
        began, times = time.perf_counter(), {"teacher_s": 0.0, "generate_s": 0.0}
        if not self.dropout_off:
            disable_dropout(engine.module)
            self.dropout_off = True
        batches, made = self.completions(engine, batches, times)
        self.record(engine.global_steps + 1, made)
        counts = [sum(int(loss_positions(b[1]).sum()) for b in batches), sum(int(input_tokens(b[1]).sum())
                                                                              for b in batches)]
        num_loss, num_input = _sum_over_ranks(counts, engine.device)
        scale = self.dp * self.gas / max(num_loss, 1.0)
        total, entropies = None, torch.zeros(2, dtype=torch.float64)
        for batch in batches:
            loss, ent_s, ent_t = self.loss_sums(engine, batch, times)
            loss = loss * scale
            engine.backward(loss)
            engine.step()
            total = loss.detach() if total is None else total + loss.detach()
            entropies += torch.stack([ent_s, ent_t]).double().cpu()
        mine = [len(r["completion_ids"]) for r in made if r["source"] == "student"]
        theirs = [len(r["completion_ids"]) for r in made if r["source"] == "teacher"]
        if self.on_policy is not None:
            self.on_policy.after_step()  # use_vllm: its weights are stale now
        ent_s, ent_t, *made = _sum_over_ranks([*entropies.tolist(), len(mine), sum(mine), len(theirs), sum(theirs)],
                                              engine.device)
        seconds = time.perf_counter() - began
        metrics = {"entropy": ent_s / max(num_loss, 1.0), "teacher_entropy": ent_t / max(num_loss, 1.0),
                   "num_tokens": int(num_input), "step_tokens": int(num_input), "time/teacher_s": times["teacher_s"],
                   "time/generate_s": times["generate_s"],
                   "time/train_s": seconds - times["teacher_s"] - times["generate_s"]}
        if self.cfg["lmbda"] > 0:  # TRL's completions/* of the student's own completions this step
            metrics.update({"completions/on_policy": int(made[0]),
                            "completions/mean_length": made[1] / made[0] if made[0] else 0.0})
        if self.seq_kd:  # seq_kd: the teacher's completions this step
            metrics.update({"completions/teacher": int(made[2]),
                            "completions/teacher_mean_length": made[3] / made[2] if made[2] else 0.0})
        return total / len(batches), metrics

    @torch.no_grad()
    def eval(self, engine, batches: list) -> tuple[torch.Tensor, dict]:
        """This rank's loss over its eval micro-batches: the sum over their loss tokens / their count; on the
        dataset's completions (gkd, as TRL's evaluation), on the student's own (distill: it has only prompts)."""
        times, sums = {"teacher_s": 0.0}, None
        if self.spec.recipe["train"]["objective"] == "distill":  # prompts only: the student's completions
            batches, _ = self.completions(engine, batches, times)
        for batch in batches:
            part = torch.stack([*self.loss_sums(engine, batch, times), loss_positions(batch[1]).sum().float()
                                .to(engine.device)])
            sums = part if sums is None else sums + part
        count = sums[3].clamp(min=1)
        return sums[0] / count, {"entropy": sums[1] / count, "teacher_entropy": sums[2] / count}
