"""The training loop: micro-steps with gradient accumulation, eval, logging, checkpoints.

Per step the loop only queues work: the loss stays a tensor on the device and nothing is all-reduced. The
losses of the steps since the last flush are averaged over ranks in ONE all-reduce at every log line, eval,
checkpoint and the last step, and their records are written then (each with its own step-end time).

Numeric faults are caught in the step itself, on every rank, by harness/train/faults.py (one small all-reduce
and host sync per step, at the optimizer step); a dropped step writes a `fault` record instead of a `train` one.
With train.on_nonfinite=off there is no per-step check: a non-finite loss is caught at the next flush, at most
train.log_every steps late.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from dataclasses import dataclass

import torch

from harness.checkpoint import files as ckpt_files
from harness.checkpoint import save as checkpoint
from harness.config.defaults import PREFERENCE_METRICS
from harness.config.objectives import objective_of, readout_of
from harness.config.readouts import step_text
from harness.config.preference_rules import is_preference
from harness.data.batches import BatchPlan
from harness.dist import DistInfo, mean_across_ranks
from harness.log import say
from harness.train import faults, mixture, schedule, zero0_step
from harness.train.metrics import MetricsLog
from harness.data.rows import Rows, loss_items, model_inputs
from harness.data.stream_rows import StreamPlan, StreamRows


# Values a step may return beside its loss ({name: this rank's mean}), averaged over ranks in the flush's all-reduce
RANK_MEANS = ("lm_loss", "aux_loss", *PREFERENCE_METRICS)  # MoE with its balancing loss; a preference run


@dataclass
class Data:
    train: Rows  # .shape == (rows, seq_len); views over the memory-mapped token store (a preference run: Pairs)
    eval: Rows
    reference: object = None  # a dpo / ipo run's reference (harness/train/reference.py); gkd's teacher (teacher.py)
    mixture: object = None  # train.datasets: the sources and their blend (harness/data/mixture.py); train, eval: MixRows
    steps: object = None  # an RL run's step (harness/train/grpo.py): it picks its own prompts and completions


def dp_coords(spec, dist: DistInfo) -> tuple[int, int]:
    """(dp_rank, dp_size). Tensor-parallel groups are consecutive ranks (parallel.tensor.TensorDataMPU): the
    ranks of one group hold shards of one replica, so they read the same rows; a pipeline's replicas are its
    topology's data coordinate."""
    if spec.pp > 1:
        from harness.model.parallel import pipe_engine

        return pipe_engine.dp_coords(spec, dist.rank)
    if spec.sp > 1:  # Ulysses: SP groups are consecutive ranks holding the same rows (model/sequence/ulysses.py)
        return dist.rank // spec.sp, spec.dp
    return dist.rank // spec.tp, spec.dp


def batch_plan(spec, dist: DistInfo, data: Data) -> BatchPlan:
    """The rows of every step; a mixture's by its blend (harness/data/mix_rows.MixPlan), a streamed store's in its
    own order (harness/data/stream_rows.StreamPlan): both have BatchPlan's interface."""
    micro, gas = spec.run.batch.micro_batch, spec.run.batch.grad_accum
    dp_rank, dp_size = dp_coords(spec, dist)
    plan = dict(global_batch=micro * gas * dp_size, micro_batch=micro, grad_accum=gas, dp_rank=dp_rank,
                dp_size=dp_size, seed=spec.recipe["train"]["seed"])
    if data.mixture is not None:
        from harness.data.mix_rows import MixPlan

        return MixPlan(sizes=tuple(data.train.sizes), blend=data.mixture.blend, **plan)
    if isinstance(data.train, StreamRows):
        return StreamPlan(data.train, **plan)
    return BatchPlan(num_rows=data.train.shape[0], **plan)


def fetch(split, rows) -> tuple[torch.Tensor, ...]:
    """(input_ids, labels[, position_ids]) of the given rows of a split; labels are -100 where a token carries no
    loss; position_ids under train.packing=document (harness/data/rows.py). Preference pairs (harness/data/
    preference.py): (input_ids, labels, pair ids), the ids keying the precomputed reference."""
    view = split[rows]
    ids = getattr(view, "ids", None)
    return view.tensors() if ids is None else (*view.tensors(), ids)


def _forward(engine, batch: tuple[torch.Tensor, ...]):
    items = loss_items(batch[1])  # from the host copy: no device sync
    # use_cache=False and no attention_mask: with either, transformers ignores the documents in position_ids
    return engine(**model_inputs(batch, engine.device), use_cache=False, num_items_in_batch=items)


def _lm_aux(engine, out) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A MoE model trained with its balancing loss (harness/model/moe/wiring.py): (LM loss, aux loss), detached;
    HF's loss is LM + router_aux_loss_coef x aux. None for every other model."""
    aux = getattr(out, "aux_loss", None)
    if aux is None:
        return None
    aux = aux.detach().float()
    return out.loss.detach().float() - engine.module.router_aux_loss_coef * aux, aux


def micro_steps(engine, batches: list):
    """One optimizer step as forward/backward/step per micro-batch; this rank's mean loss (a device tensor), and
    for a MoE model with its balancing loss on, (loss, {"lm_loss": ..., "aux_loss": ...}) means alike."""
    total, parts = None, None
    for batch in batches:
        out = _forward(engine, batch)
        engine.backward(out.loss)
        engine.step()
        total = out.loss.detach().float() if total is None else total + out.loss.detach().float()
        if (split := _lm_aux(engine, out)) is not None:
            parts = list(split) if parts is None else [a + b for a, b in zip(parts, split)]
    if parts is None:
        return total / len(batches)
    return total / len(batches), {"lm_loss": parts[0] / len(batches), "aux_loss": parts[1] / len(batches)}


@torch.no_grad()
def micro_eval(engine, batches: list) -> float:
    """This rank's mean LM loss over its eval micro-batches (a balancing loss is not part of it)."""
    losses = []
    for batch in batches:
        out = _forward(engine, batch)
        split = _lm_aux(engine, out)
        losses.append((split[0] if split is not None else out.loss).float().item())
    return sum(losses) / len(losses)


def strategy(spec, reference=None, run_dir=None):
    """(train step, eval) functions: the pipeline engine runs a whole step in train_batch / eval_batch; a
    preference or distillation objective has its own (pipeline, tensor and sequence parallel are refused with it).
    run_dir: the training run's folder, where a distillation run records its generated completions (rollouts.jsonl);
    None for an evaluation's steps."""
    if is_preference(spec.recipe) or objective_of(spec.recipe).family == "distill":  # its step class (objectives.py)
        import importlib

        module, name = objective_of(spec.recipe).steps.split(":")
        folder = {"run_dir": run_dir} if objective_of(spec.recipe).family == "distill" else {}
        steps = getattr(importlib.import_module(module), name)(spec, reference, **folder)
        return steps.train, steps.eval
    from harness.train.vision_steps import VisionSteps, is_vision_run

    if is_vision_run(spec):  # every rank calls the vision tower alike (pipeline, tensor, sequence parallel refused)
        steps = VisionSteps(spec)
        return steps.train, steps.eval
    if spec.pp > 1:
        from harness.model.parallel import pipe_engine

        return pipe_engine.train_step, pipe_engine.eval_loss
    from harness.model.sequence import steps as sequence

    if sequence.uses_sequence_path(spec):  # SP, tiling, activation offload: the harness's own loss reduction
        path = sequence.Steps.of(spec)
        return path.train, path.eval
    return micro_steps, micro_eval


def evaluate(engine, spec, dist: DistInfo, data: Data) -> dict:
    """{"eval_loss": mean loss[, "eval_<metric>": ...]} over the same eval rows every time: rank r takes rows r,
    r + dp, ... (equal count per rank)."""
    if data.eval.shape[0] == 0:
        return {"eval_loss": float("nan")}
    micro = spec.run.batch.micro_batch
    dp_rank, dp_size = dp_coords(spec, dist)
    per_rank = max(1, min(spec.recipe["train"]["eval_batches"] * micro, data.eval.shape[0] // dp_size))
    rows = data.eval[dp_rank::dp_size][:per_rank]
    if rows.shape[0] == 0:  # fewer eval rows than replicas (long rows, a small set): this one repeats a row
        rows = data.eval[dp_rank % data.eval.shape[0]:][:1]
    engine.eval()
    loss = strategy(spec, data.reference)[1](engine, [fetch(rows, slice(i, i + micro))
                                                      for i in range(0, rows.shape[0], micro)])
    engine.train()
    loss, parts = loss if isinstance(loss, tuple) else (loss, {})  # a preference run: its metrics too
    values = mean_across_ranks([loss, *parts.values()])
    return dict(zip(["eval_loss", *(f"eval_{k}" for k in parts)], values))


@dataclass(frozen=True)
class Boundaries:
    """What the trainer tells and asks at the step boundaries: the hooks (profiling, trackers), told every step
    and record, and the preemption (harness.train.preempt.Preemption; None: never stop early)."""

    hooks: tuple = ()
    preempt: object = None


class Trainer:
    def __init__(self, engine, spec, dist: DistInfo, data: Data, run_dir, log: MetricsLog,
                 boundaries: Boundaries = Boundaries(), *, model_info, skipped_batches=()):
        """skipped_batches: data batches earlier rollbacks stepped over (the resumed checkpoint's client state)."""
        self.engine, self.spec, self.dist, self.data = engine, spec, dist, data
        self.model_info = model_info  # harness.model.load.meta.ModelInfo: dtypes and partition for the manifests
        self.run_dir, self.log, self.hooks = run_dir, log, list(boundaries.hooks)
        self.preempt = boundaries.preempt  # asked at every step boundary
        self.plan = data.steps.plan if data.steps is not None else batch_plan(spec, dist, data)
        self.train_cfg = spec.recipe["train"]
        self.readout = readout_of(spec.recipe)  # the [step] line's metrics (harness/config/readouts.py)
        rows_per_sample = 2 if is_preference(spec.recipe) else 1  # a pair is two rows
        self.tokens_per_step = self.plan.global_batch * data.train.shape[1] * rows_per_sample
        self.step_fn = strategy(spec, data.reference, run_dir)[0] if data.steps is None else None
        if data.mixture is not None:  # loss/<name>, rows/<name> (harness/train/mixture.py)
            plain = mixture.plain_path(spec)
            self.step_fn = mixture.by_source(self.step_fn, len(data.mixture.names), *((_forward, _lm_aux) if plain
                                                                                     else ()))
        self.guard = faults.Guard.of(engine, self.train_cfg, dist.rank, dist.world_size)  # None: on_nonfinite off
        zero0_step.install(engine)  # ZeRO-0 fp32: its grad norm (after the guard: a dropped step is measured too)
        self.policy = faults.Policy(self.train_cfg)
        self.data_steps = faults.DataSteps(skipped_batches)

    def train_step(self, step: int) -> dict:
        start = time.perf_counter()
        lr = float(self.engine.get_lr()[0] if self.engine.lr_scheduler is not None
                   else self.engine.optimizer.param_groups[0]["lr"])  # a 0-d tensor under torchao's _AdamW
        batch = self.data_steps.batch(step)
        if self.guard is not None:
            self.guard.begin(batch)
        if self.data.steps is not None:  # an RL step picks its own prompts and completions
            loss = self.data.steps.train(self.engine, step)
        else:
            micro = self.plan.micro_batches(batch)
            batches = [fetch(self.data.train, rows) for rows in micro]
            if self.data.mixture is None:
                loss = self.step_fn(self.engine, batches)
            else:  # with each row's source
                loss = self.step_fn(self.engine, batches, [self.data.train[rows].source_ids() for rows in micro])
        loss, parts = loss if isinstance(loss, tuple) else (loss, {})  # RANK_MEANS: MoE's, a preference run's
        step_time = time.perf_counter() - start
        self.tokens_per_step = parts.get("step_tokens", self.tokens_per_step)  # an RL step's own count
        norm = self.engine.get_global_grad_norm()
        norm = norm.detach().clone() if torch.is_tensor(norm) else norm  # read (synchronised) at the flush
        return {"loss": loss, **parts, "lr": lr, "grad_norm": norm,
                "step_time_s": step_time, "tokens_per_s": self.tokens_per_step / step_time,
                "samples_per_s": self.plan.global_batch / step_time}

    def flush(self, pending: list[tuple[int, float, dict]]) -> float:
        """Average the pending steps' losses over ranks (one all-reduce), check them, write their records.
        Returns the last step's loss."""
        if self.data.mixture is not None:
            mixture.flush_sources(pending, self.data.mixture.names, self.dist.world_size // self.plan.dp_size)
        parts = [(record, key) for _, _, record in pending for key in RANK_MEANS if key in record]
        values = mean_across_ranks([record["loss"] for _, _, record in pending] + [r[key] for r, key in parts])
        losses = values[:len(pending)]
        for (record, key), value in zip(parts, values[len(pending):]):
            record[key] = value  # each rank's value is of its own micro-batches; logged as the mean
        for (done, at, record), loss in zip(pending, losses):
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss is {loss} at step {done}; lower optimizer.lr or check the data")
            norm = record["grad_norm"]
            record.update(loss=loss, grad_norm=float(norm) if norm is not None else None)
            self.log.write("train", done, at=at, **record)
            self.notify("train", done, record)
        return losses[-1]

    def on_fault(self, step: int, verdict) -> int | None:
        """A step every rank dropped (harness/train/faults.py): log it, then stop (raises NumericFault), skip
        (None: go on) or roll back (the step to continue from)."""
        action, why = self.policy.action(step)
        batch = self.data_steps.batch(step)
        rows = {r: faults.rows_named(self.data.train[self.rank_rows(r, batch)]) for r in verdict.ranks[:4]}
        self.log.write("fault", step + 1, **faults.record(verdict, batch, action, rows))
        text = faults.describe(verdict, step + 1, batch, rows, self.train_cfg)
        if action == "stop":
            tag = ckpt_files.latest_tag(self.run_dir / "checkpoints")
            raise faults.NumericFault(f"{text}; stopped ({why}): nothing saved after the fault, `latest` names "
                                      f"{tag or 'no checkpoint'}\n    fix: {faults.FIX}")
        if action == "skip":
            if self.dist.is_main:
                say("fault", f"{text}; update dropped, step skipped")
            return None
        return self.rollback(batch, text)

    def rollback(self, batch: int, text: str) -> int:
        """Reload `latest` in this process and step over data batch `batch` from now on; the checkpoint's step."""
        ckpt_dir = self.run_dir / "checkpoints"
        tag = ckpt_files.latest_tag(ckpt_dir)
        if tag is None:
            raise faults.NumericFault(f"{text}; train.on_nonfinite is rollback but no checkpoint was saved yet\n"
                                      f"    fix: a smaller train.save_every; {faults.FIX}")
        launched_lrs = schedule.group_lrs(self.engine) if self.engine.lr_scheduler is None else None
        client = checkpoint.load(self.engine, self.dist, ckpt_dir, tag, strict=not checkpoint.frozen_excluded(self.spec))
        schedule.align(self.engine, int(client["step"]), launched_lrs)
        self.data_steps = faults.DataSteps([*client.get(faults.CLIENT_KEY, []), *self.data_steps.skipped, batch])
        back = int(client["step"])
        if self.dist.is_main:
            say("fault", f"{text}; rolled back to {tag} (step {back}), data batch {batch} skipped from now on")
        self.log.write("rollback", back, tag=tag, skipped_batch=batch)
        return back

    def rank_rows(self, rank: int, batch: int):
        """Positions in the training split of data batch `batch` on `rank` (any rank's: the plan is arithmetic)."""
        plan = batch_plan(self.spec, dataclasses.replace(self.dist, rank=rank), self.data)
        return torch.cat(plan.micro_batches(batch))

    def notify(self, kind: str, step: int, record: dict) -> None:
        """Hooks that want the logged values (e.g. the loss for DeepSpeed's monitors) define on_record."""
        for hook in self.hooks:
            if hasattr(hook, "on_record"):
                hook.on_record(kind, step, record)

    def should(self, every: int, step: int, last: int) -> bool:
        return (every > 0 and step % every == 0) or step == last

    def save(self, step: int) -> None:
        # under SP checkpoint.save shards the probe over the SP ranks (model/sequence/ulysses.probe_logits)
        probe = fetch(self.data.eval if self.data.eval.shape[0] else self.data.train, slice(0, 1))[0][:, :16]
        client = {"step": step, "epoch": self.plan.epoch_of(self.data_steps.batch(max(step - 1, 0))),
                  faults.CLIENT_KEY: list(self.data_steps.skipped),
                  **(self.data.steps.client_state() if self.data.steps is not None else {})}
        if self.data.mixture is not None:
            client.update(self.data.mixture.client_state())
        path = checkpoint.save(self.engine, self.spec, self.dist, self.run_dir / "checkpoints", step, client,
                               probe_ids=probe, model_info=self.model_info)
        if self.dist.is_main:
            say("ckpt", f"step {step} -> {path}")
            self.log.write("checkpoint", step, path=str(path))

    def run(self, start_step: int) -> dict:
        from tqdm import tqdm

        total = self.train_cfg["steps"]
        bar = tqdm(total=total, initial=start_step, desc="train", disable=not (self.dist.is_main and sys.stderr.isatty()), dynamic_ncols=True)
        first = last = None
        eval_loss = None
        pending: list[tuple[int, float, dict]] = []  # (step, step-end time, record) not yet flushed
        mark, mark_step = time.perf_counter(), start_step
        step = start_step
        while step < total:
            for hook in self.hooks:
                hook.before_step(step)
            record = self.train_step(step)
            for hook in self.hooks:
                record.update(hook.after_step(step) or {})
            done = step + 1
            verdict = self.guard.verdict() if self.guard is not None else None
            if verdict is None:
                self.policy.kept(step)
                pending.append((done, time.time(), record))
            else:  # dropped on every rank: the records before it first, then stop, skip or roll back
                if pending:
                    last = self.flush(pending)
                    first = pending[0][2]["loss"] if first is None else first
                    pending = []
                back = self.on_fault(step, verdict)
                if back is not None:  # rolled back: continue from the checkpoint's step
                    bar.update(back - done)
                    step, mark, mark_step = back, time.perf_counter(), back
                    continue
            bar.update(1)
            eval_now = self.should(self.train_cfg["eval_every"], done, total) and self.data.steps is None
            stop = done < total and self.preempt is not None and self.preempt.stop_after(done)  # last: saved anyway
            save_now = self.should(self.train_cfg["save_every"], done, total) or stop
            log_now = done % self.train_cfg["log_every"] == 0
            flush_now = (log_now or eval_now or save_now or done == total) and bool(pending)
            if flush_now:
                last = self.flush(pending)
                first = pending[0][2]["loss"] if first is None else first
                pending = []
                now = time.perf_counter()  # after the all-reduce: on CUDA the queued steps have finished
                tokens_per_s = self.tokens_per_step * (done - mark_step) / (now - mark)
                bar.set_postfix_str(f"{step_text(self.readout, record)}, {tokens_per_s:.0f} tok/s, lr {record['lr']:.1e}")
                if self.dist.is_main and log_now:
                    norm = f"{record['grad_norm']:.3f}" if record["grad_norm"] is not None else "n/a"
                    say("step", f"{done}/{total} {step_text(self.readout, record)} lr {record['lr']:.2e} "
                                f"grad_norm {norm} {tokens_per_s:.0f} tok/s")
            if eval_now:
                evals = evaluate(self.engine, self.spec, self.dist, self.data)
                if self.data.mixture is not None:
                    evals.update(mixture.source_evals(evaluate, self.engine, self.spec, self.dist, self.data))
                eval_loss = evals["eval_loss"]
                self.log.write("eval", done, **evals)
                self.notify("eval", done, evals)
                if self.dist.is_main:
                    say("eval", f"step {done}: eval loss {eval_loss:.4f}")
            if save_now:
                self.save(done)
            if flush_now:
                mark, mark_step = time.perf_counter(), done  # throughput over training steps only
            if stop:
                self.log.write("preempted", done, reason=self.preempt.reason)
                if self.dist.is_main:
                    say("preempt", f"stopped at step {done} ({self.preempt.reason}), checkpoint saved; "
                                   "continue with --resume latest")
                bar.close()
                return {"first_loss": first, "last_loss": last, "eval_loss": eval_loss, "preempted_at": done,
                        **self.check_cost()}
            step = done
        bar.close()
        return {"first_loss": first, "last_loss": last, "eval_loss": eval_loss, **self.check_cost()}

    def check_cost(self) -> dict:
        """For summary.json: what the per-step numeric-fault check took (harness/train/faults.py)."""
        return self.guard.cost_ms() if self.guard is not None else {}
