"""The step of an online RL run (train.objective grpo) on ddp and ZeRO-0..3, offload and LoRA.

Per generation (every num_iterations steps): the step's prompts (global_batch / num_generations of them, the same
on every rank) -> each rank generates its contiguous slice of the step's completions (num_generations per prompt,
group after group) -> rewards on its slice -> every rank gathers the step's records and computes the advantages
(a group may span ranks) -> the old policy's log-probs when num_iterations > 1 (or as a replay file gives them)
-> the reference's when beta > 0 -> rank 0 appends the records to RUN/rollouts.jsonl. rl.replay takes the records
from its file instead of generating and scoring.

Per step: the loss (harness/rl/loss.py) over the rank's grad_accum micro-batches of micro_batch completions, with
engine.backward / engine.step, then the generator's weight sync. The metrics carry TRL's names and the time split
(time/generate_s, tools_s: multi-turn tool calls and templates, score_s, reference_s, train_s, sync_s).
"""

from __future__ import annotations

import functools
import inspect
import time
from pathlib import Path

import torch

from harness.config.readouts import RL_TIMES
from harness.dist import gather_all
from harness.data.batches import BatchPlan
from harness.errors import UsageError
from harness.log import say
from harness.rl import generation_batch as gb
from harness.rl import replay as replay_file
from harness.rl.loss import completion_logits, per_token_loss, reduce, token_logps
from harness.rl.rollouts import ROLLOUTS_FILE, Rollouts, append, first_eos, lines, truncate_after
from harness.rl.step_metrics import StepMetrics

CLIENT_KEY = "rl_generation"  # the current generation's records, in the checkpoint's client state (num_iterations > 1)
NEAR_ZERO = ("on-policy (num_iterations 1) the importance ratio is 1 and each group's advantages sum to ~0, so the "
             "logged loss sits near 0 (plus beta x KL) while its gradient does not: watch reward, not loss")


def forward_logps(engine, t: dict, temperature: float, entropy: bool):
    """(per-token log-probs [B, C], entropy [B, C] or None) of the completions in micro-batch tensors t. The model
    computes logits from the first completion position of the micro-batch onward only (transformers'
    logits_to_keep, as TRL's): the prompt positions before it would give logits nobody reads."""
    width, total = t["completion"].shape[1], t["input_ids"].shape[1]
    keep = total - int(t["prompt_len"].min()) + 1
    extra = {"logits_to_keep": keep} if keeps_logits(engine.module) else {}
    logits = engine(input_ids=t["input_ids"].to(engine.device), use_cache=False, **extra).logits
    comp = completion_logits(logits, t["prompt_len"] - (total - logits.shape[1]), width)
    return token_logps(comp, t["completion"].to(logits.device), temperature, entropy)


def keeps_logits(module) -> bool:
    """Whether the model's forward takes logits_to_keep (transformers' causal LMs do; peft's wrappers pass it on)."""
    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    return _takes_logits_to_keep(type(base))


@functools.lru_cache(maxsize=None)
def _takes_logits_to_keep(cls) -> bool:
    return "logits_to_keep" in inspect.signature(cls.forward).parameters


class GrpoSteps:
    def __init__(self, spec, dist, data, run_dir: Path, *, tokenizer, reference=None):
        self.rl, self.spec, self.dist, self.run_dir = spec.recipe["rl"], spec, dist, Path(run_dir)
        self.g, self.mu = self.rl["num_generations"], self.rl["num_iterations"]
        self.micro, self.gas = spec.run.batch.micro_batch, spec.run.batch.grad_accum
        self.dp_rank, self.dp = dist.rank, dist.world_size  # tp / pp / sp are refused (config/rl_rules.py)
        self.per_rank = self.micro * self.gas
        self.total = self.per_rank * self.dp
        self.prompts, self.tokenizer, self.reference = data.train, tokenizer, reference
        self.eos_ids = (tokenizer.eos_token_id,)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.plan = BatchPlan(num_rows=self.prompts.shape[0], global_batch=self.total // self.g,
                              micro_batch=self.total // self.g, grad_accum=1, seed=spec.recipe["train"]["seed"])
        self.replay = None
        if self.rl["replay"]:
            self.replay = replay_file.read(self.rl["replay"], self.eos_ids)
        self.generator = self.rewards = self.multiturn = self.async_gen = None
        self.names, self.weights = (), ()
        self.buffer: tuple[Rollouts, list[dict], int] | None = None  # (rollouts, the step's records, loss tokens)

    def start(self, engine, step0: int, client: dict) -> None:
        """After the engine exists and the checkpoint (if any) is loaded: the generator and rewards (live runs),
        a generation in progress from the checkpoint, the start-up lines."""
        if self.replay is None:
            from harness.rl.generation import make_generator
            from harness.rl.rewards import load_rewards

            rl = self.rl
            if not rl["rewards"] and self.spec.recipe["train"]["dataset"] == "builtin":
                from harness.rl import toy

                rl = {**rl, "rewards": [toy.REWARD]}
            if rl["async"]:  # generator processes of their own (harness/rl/async_rollouts.py)
                from harness.rl.async_rollouts import AsyncGeneration
                from harness.rl.generation.vllm_server import ServerGeneration

                kind = ServerGeneration if rl["generator"] == "vllm" else AsyncGeneration  # rl.vllm_mode server
                self.async_gen = kind(rl, engine, self.tokenizer, self._request, rank=self.dp_rank,
                                      last_step=self.spec.recipe["train"]["steps"] - 1)
            else:
                self.generator = make_generator(rl, engine, self.tokenizer, self.spec.run)
            box = self.prompts.toolbox
            self.rewards = load_rewards(rl, tokenizer=self.tokenizer, base_dir=Path.cwd(),
                                        ds_config=self.spec.ds_config,
                                        environment_rewards=box.reward_functions() if box else None)
            if box is not None:
                from harness.rl.multiturn import MultiTurn

                self.multiturn = MultiTurn(rl, self.tokenizer, box, self.generator,
                                           self.spec.recipe["train"].get("prompt_field", "prompt"))
            self.names, self.weights = tuple(self.rewards.names), tuple(self.rewards.weights)
        if client.get(CLIENT_KEY) and step0 % self.mu:
            kept = client[CLIENT_KEY]
            if len(kept) != self.total:
                raise UsageError(f"resuming at step {step0}, inside a generation (rl.num_iterations {self.mu}) of "
                                 f"{len(kept)} completions, with a global batch of {self.total}: the generation's "
                                 "remaining steps need its own batch\n    fix: resume with the global batch it was "
                                 "saved with (batch.train_batch_size), or from a checkpoint at a generation's start")
            self.buffer = self._assemble(engine, [dict(r) for r in kept])
        if self.dist.is_main:
            truncate_after(self.run_dir, step0)
            self._announce()
        if self.async_gen is not None:
            self.async_gen.start(step0)

    def _announce(self) -> None:
        rl = self.rl
        say("rl", f"grpo: loss {rl['loss_type']} ({rl['importance_sampling_level']} ratios), {self.total} completions "
                  f"per step = {self.total // self.g} prompts x {self.g} generations ({self.micro} micro x "
                  f"{self.gas} accum x {self.dp} ranks), {self.mu} step(s) per generation, beta {rl['beta']}")
        source = f"replay of {rl['replay']}" if self.replay is not None else \
            f"generator {rl['generator']}, rewards {', '.join(self.names)}"
        if rl["async"]:
            from harness.train.grpo_async import describe

            say("rl", describe(rl))
        say("rl", f"rollouts: {source} -> {self.run_dir / ROLLOUTS_FILE}")
        if self.multiturn is not None:
            from harness.rl.multiturn import describe

            say("rl", describe(rl, self.prompts.toolbox))
        if self.mu == 1:
            say("rl", f"why the loss sits near 0: {NEAR_ZERO}")

    def client_state(self) -> dict:
        """The current generation's records when later steps reuse it (num_iterations > 1)."""
        return {CLIENT_KEY: self.buffer[1]} if self.mu > 1 and self.buffer is not None else {}

    # --- a generation ---
    def _records(self, engine, step: int, times: dict) -> list[dict]:
        """The step's records in order: from the replay file, or generated and scored here."""
        if self.replay is not None:
            return [dict(r) for r in self.replay[step + 1]]
        index, prompt_ids, seed, first = self._slice(step)
        began = time.perf_counter()
        if self.multiturn is not None:
            local = self._multi_turn(index, prompt_ids, seed, first, step, times)
            return [r for part in gather_all(local) for r in part]
        if self.async_gen is not None:
            from harness.train import grpo_async as async_steps

            return async_steps.records(self, step, index, prompt_ids, times)
        completions = self.generator.generate(prompt_ids, seed=seed, first_row=first)
        times["generate_s"] = time.perf_counter() - began
        return [r for part in gather_all(self._scored(index, prompt_ids, completions, times)) for r in part]

    def _scored(self, index: list[int], prompt_ids: list, completions: list, times: dict) -> list[dict]:
        """This rank's single-turn records: the completions scored."""
        began = time.perf_counter()
        scores = self._score(index, completions)
        times["score_s"] = time.perf_counter() - began
        return [{"prompt_index": self.prompts.records[i], "prompt_ids": p, "completion_ids": list(c),
                 "finish": "length" if first_eos(list(c), self.eos_ids) is None else "eos",
                 "rewards": dict(zip(self.names, s))} for i, p, c, s in zip(index, prompt_ids, completions, scores)]

    def _slice(self, step: int) -> tuple[list[int], list, int, int]:
        """This rank's rows of the step: (prompt records, prompt ids, the generation's seed, the first global row).
        Row i of the step draws from (seed, i): the same completions on any world size."""
        rows = self.plan.global_rows(step // self.mu).tolist()
        mine = range(self.dp_rank * self.per_rank, (self.dp_rank + 1) * self.per_rank)
        index = [rows[j // self.g] for j in mine]
        seed = self.spec.recipe["train"]["seed"] * 1000003 + step // self.mu
        return index, [self.prompts.token_ids[i] for i in index], seed, mine.start

    def _request(self, step: int) -> tuple[list, int, int]:
        """What the async generator needs to sample the step's rows of this rank."""
        _, prompt_ids, seed, first = self._slice(step)
        return prompt_ids, seed, first

    def _multi_turn(self, index: list[int], prompt_ids: list, seed: int, first: int, step: int, times: dict) -> list:
        """This rank's multi-turn rollouts (harness/rl/multiturn.py), scored with environments= as TRL's."""
        began = time.perf_counter()
        columns = {k: [v[i] for i in index] for k, v in self.prompts.columns.items()}
        names = [f"step {step + 1}, row {first + j} (prompt record {self.prompts.records[i]})"
                 for j, i in enumerate(index)]
        rollouts = self.multiturn.start([self.prompts.values[i] for i in index], prompt_ids, columns,
                                        list(range(first, first + len(index))), names)
        self.multiturn.run(rollouts, seed)
        loop = time.perf_counter() - began  # tools_s: environments' reset, tool calls, their suffixes' rendering
        times["generate_s"], times["tools_s"] = self.multiturn.generate_s, loop - self.multiturn.generate_s
        began = time.perf_counter()
        scores = self.rewards.score(prompts=[r.prompt for r in rollouts], completions=[r.replies for r in rollouts],
                                    completion_ids=[r.completion for r in rollouts],
                                    columns={**columns, "environments": [r.environment for r in rollouts]})
        times["score_s"] = time.perf_counter() - began
        return [{"prompt_index": self.prompts.records[i], **r.record(),
                 "rewards": dict(zip(self.names, [0.0] * len(s) if r.finish == "error" else s))}
                for i, r, s in zip(index, rollouts, scores)]

    def _score(self, index: list[int], completions: list[list[int]]) -> list[list]:
        texts = [self.tokenizer.decode(gb_kept(c, self.eos_ids), skip_special_tokens=True) for c in completions]
        prompts = [self.prompts.values[i] for i in index]
        if prompts and not isinstance(prompts[0], str):  # conversational: the completion as an assistant message
            texts = [[{"role": "assistant", "content": t}] for t in texts]
        columns = {k: [v[i] for i in index] for k, v in self.prompts.columns.items()}
        return self.rewards.score(prompts=prompts, completions=texts, completion_ids=completions, columns=columns)

    def _assemble(self, engine, records: list[dict]) -> tuple[Rollouts, list[dict], int]:
        rollouts = gb.local_rollouts(records, self.dp_rank, self.per_rank, self.eos_ids, self.rl["async"])
        tokens = gb.step_loss_tokens(records, self.eos_ids, self.rl["mask_truncated_completions"])
        return rollouts, records, tokens

    @torch.no_grad()
    def _logps(self, engine, rollouts: Rollouts, reference: bool) -> list[torch.Tensor]:
        """Per kept token log-probs of this rank's completions: the policy's now (the old policy), or the
        reference's (its engine, or the policy with the adapters off)."""
        out = []
        for m in range(self.gas):
            t = rollouts.tensors(range(m * self.micro, (m + 1) * self.micro), self.pad_id, False)
            if reference and self.reference.mode == "engine":
                logps, _ = forward_logps(self.reference.engine, t, self.rl["temperature"], False)
            elif reference:
                from harness.train.reference import adapters_off

                with adapters_off(engine.module):
                    logps, _ = forward_logps(engine, t, self.rl["temperature"], False)
            else:
                was = engine.module.training
                engine.module.eval()
                logps, _ = forward_logps(engine, t, self.rl["temperature"], False)
                engine.module.train(was)
            out += [row[:len(rollouts.kept(i))].float().cpu() for i, row in zip(t_rows(m, self.micro), logps)]
        return out

    def generation(self, engine, step: int, times: dict) -> dict:
        records = self._records(engine, step, times)
        metrics = gb.fill_advantages(records, self.rl, self.names, self.weights)
        metrics.update(gb.completion_metrics(records, self.eos_ids))
        rollouts, records, tokens = self._assemble(engine, records)
        if self.mu > 1 and rollouts.old_logps is None:
            rollouts.old_logps = self._logps(engine, rollouts, reference=False)
            every = [x for part in gather_all([o.tolist() for o in rollouts.old_logps]) for x in part]
            for r, o in zip(records, every):
                r["old_logps"] = o
        began = time.perf_counter()
        if self.reference is not None:
            rollouts.ref_logps = self._logps(engine, rollouts, reference=True)
        times["reference_s"] = time.perf_counter() - began
        self.buffer = (rollouts, records, tokens)
        if self.dist.is_main and self.async_gen is None:  # async: after the step, with the ratios it used
            append(self.run_dir, lines(step + 1, self.g, records))
        return metrics

    # --- the step ---
    def train(self, engine, step: int) -> tuple[torch.Tensor, dict]:
        times = dict.fromkeys(RL_TIMES, 0.0)
        metrics = {}
        if step % self.mu == 0 or self.buffer is None:
            metrics = self.generation(engine, step, times)
        else:  # a later iteration on the same generation: the same tokens
            metrics = {"step_tokens": gb.completion_metrics(self.buffer[1], self.eos_ids)["step_tokens"]}
        began = time.perf_counter()
        loss, stats = self._update(engine)
        times["train_s"] = time.perf_counter() - began
        began = time.perf_counter()
        if self.generator is not None:
            self.generator.after_step()
        if self.async_gen is not None:
            from harness.train import grpo_async as async_steps

            stats.update(async_steps.after_update(self, step))
        times["sync_s"] = time.perf_counter() - began
        metrics.update(stats)
        metrics.update({f"time/{k}": v for k, v in times.items()})
        return loss, metrics

    def _update(self, engine) -> tuple[torch.Tensor, dict]:
        rollouts, _, tokens = self.buffer
        rl, total, metrics = self.rl, None, StepMetrics()
        self.ratios = []  # rl.async: per row, the importance ratio of each kept token the loss used
        for m in range(self.gas):
            t = rollouts.tensors(range(m * self.micro, (m + 1) * self.micro), self.pad_id,
                                 rl["mask_truncated_completions"])
            logps, entropy = forward_logps(engine, t, rl["temperature"], True)
            mask = t["mask"].to(logps.device)
            old = logps.detach() if t["old"] is None else t["old"].to(logps.device, logps.dtype)
            ref = None if t["ref"] is None else t["ref"].to(logps.device)
            weight = None
            if t["sampling"] is not None:  # rl.async: corrected toward the generator's sampling log-probs
                from harness.rl.loss import correction

                old, weight, used = correction(logps, t["sampling"].to(logps.device, logps.dtype), mask, rl)
                self.ratios += [row[:len(rollouts.kept(i))].tolist() for i, row in zip(t_rows(m, self.micro), used)]
            ptl, stats, per_seq = per_token_loss(logps, old, ref, t["advantages"].to(logps.device), mask, rl)
            if weight is not None:  # truncated importance sampling: the loss weighted by the capped ratio
                ptl = ptl * weight
            loss = reduce(ptl, mask, rl, tokens, self.dp * self.gas)
            engine.backward(loss)
            engine.step()
            stats["entropy"] = ((entropy * mask).sum(), mask.sum())
            metrics.add(stats, per_seq)
            total = loss.detach().float() if total is None else total + loss.detach().float()
        return total / self.gas, metrics.reduce()


def t_rows(m: int, micro: int) -> range:
    return range(m * micro, (m + 1) * micro)


def gb_kept(ids: list[int], eos_ids: tuple[int, ...]) -> list[int]:
    end = first_eos(list(ids), eos_ids)
    return list(ids) if end is None else list(ids)[:end + 1]

