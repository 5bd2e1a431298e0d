"""Completions generated during a distillation run (gkd with distill.lmbda > 0 or seq_kd, objective distill),
through the RL generators as they stand (harness/rl/generation: HF generate on the live weights, ZeRO-3 gathers
bounded by the planner; with distill.use_vllm, TRL's key, a colocated vLLM on GPU, synced after each optimizer step).

TRL's GKDTrainer draws one coin per micro-batch and process: with probability lmbda the student generates the
micro-batch's completions, else with seq_kd the teacher does, else the dataset's are used. Here the coin is drawn per
ROW, from the stream (seed of the step, the row's position in the step's global batch), and so is the row's
completion (the generators' RowSampler), whoever generates it: a step's completions and losses are the same on any
world size and accumulation, and a resumed run continues the uninterrupted one exactly. The expected share of
on-policy completions is lmbda, as TRL's. Every rank calls the student's generator once per micro-batch, and with
seq_kd the teacher's once after it (each a collective under ZeRO-3), whether or not any of its rows drew it.

A drawn row keeps its prompt and gets the student's (or the teacher's) completion (at most distill.max_new_tokens
tokens, sampled at distill.temperature, EOS included when generated), cut at train.seq_len; its labels are the new
completion's tokens. The teacher generates as an engine (teacher_mode engine: the frozen teacher engine, ZeRO-3
gathers as the student's) or as the student's base with the adapters off (adapter); precomputed and served teachers
cannot generate (refused before launch: config/distill_rules.py, distill_topk_rules.py).
"""

from __future__ import annotations

import torch

from harness.config.distill_rules import settings
from harness.data.rows import IGNORE_INDEX
from harness.rl.generation.sampling import row_seed
from harness.rl.rollouts import first_eos

SEED_STRIDE = 1000003  # the step's seed: train.seed x this + the step (as the RL loop's)
STUDENT, TEACHER = "student", "teacher"  # who generated a row's completion (rollouts.jsonl's `source`)


class OnPolicy:
    def __init__(self, spec, engine, teacher=None):
        """engine: the student's; teacher: the run's Teacher (harness/train/teacher.py), asked to generate with
        seq_kd."""
        from harness.model.hf import load_tokenizer
        from harness.rl.generation import make_generator

        cfg = settings(spec.recipe)
        self.lmbda, self.seed = cfg["lmbda"], spec.recipe["train"]["seed"]
        tokenizer = load_tokenizer(spec.recipe["train"]["model"])
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.eos_ids = (tokenizer.eos_token_id,)
        rl = {"generator": "hf", "max_completion_length": cfg["max_new_tokens"] or cfg["max_completion_length"],
              "temperature": cfg["temperature"], "top_k": 0, "top_p": 1.0}
        student = {**rl, "generator": "vllm" if cfg["use_vllm"] else "hf", "max_prompt_length": spec.recipe[
            "train"]["seq_len"], "vllm_gpu_memory_utilization": cfg["vllm_gpu_memory_utilization"]}
        self.generators = {STUDENT: make_generator(student, engine, tokenizer, spec.run)}
        if cfg["seq_kd"] and spec.recipe["train"]["objective"] == "gkd":  # the teacher's weights never change: hf
            self.generators[TEACHER] = teacher.generator(rl, engine, tokenizer, spec.run)

    def after_step(self) -> None:
        """After each optimizer step: vLLM's copy of the student's weights is stale (synced at the next generation)."""
        self.generators[STUDENT].after_step()

    def draws(self, step: int, first_row: int, rows: int) -> list[str | None]:
        """Per row: who generates its completion (the student with probability lmbda, else the teacher with seq_kd,
        else None: the dataset's), each from its own stream, independent of the batching."""
        seed = self.seed * SEED_STRIDE + step
        other = TEACHER if TEACHER in self.generators else None
        return [STUDENT if torch.rand(1, generator=torch.Generator().manual_seed(row_seed(seed, first_row + i)),
                                      dtype=torch.float64).item() < self.lmbda else other for i in range(rows)]

    def batch(self, step: int, first_row: int, batch: tuple[torch.Tensor, ...]) -> tuple[tuple[torch.Tensor, ...],
                                                                                       list[dict]]:
        """(the micro-batch with its drawn rows' completions generated and a 5th tensor: [B] bool, the row's completion
        was generated (after the prompt lengths and the record numbers: harness/train/distill.py); a record per
        generated row, in row order: row (its position in the step's global batch), prompt_index (its record),
        prompt_ids, completion_ids (as generated), finish (eos | length), source (student | teacher))."""
        input_ids, labels = batch[0].clone(), batch[1].clone()
        who = self.draws(step, first_row, input_ids.shape[0])
        made = {}
        for source in self.generators:  # the same order on every rank: each call is a collective under ZeRO-3
            chosen = [i for i, w in enumerate(who) if w == source]
            prompts = [input_ids[i, :int(batch[2][i])].tolist() for i in chosen]  # batch[2]: the prompt lengths
            made.update(zip(chosen, self._generate(source, step, first_row, chosen, prompts)))
        width = input_ids.shape[1]
        records = []
        for i in sorted(made):
            start, completion = int(batch[2][i]), made[i]
            row = (input_ids[i, :start].tolist() + completion)[:width]
            records.append({"row": first_row + i, "prompt_index": int(batch[3][i]), "prompt_ids": row[:start],
                            "completion_ids": list(completion), "source": who[i],
                            "finish": "length" if first_eos(list(completion), self.eos_ids) is None else "eos"})
            input_ids[i] = self.pad_id
            input_ids[i, :len(row)] = torch.tensor(row)
            labels[i] = IGNORE_INDEX
            labels[i, start:len(row)] = input_ids[i, start:len(row)]
        generated = torch.zeros(input_ids.shape[0], dtype=torch.bool)
        generated[sorted(made)] = True
        return (input_ids, labels, *batch[2:4], generated), records

    def _generate(self, source: str, step: int, first_row: int, chosen: list[int], prompts: list) -> list[list[int]]:
        """One generate call per micro-batch and generator (collective), every row drawing from (step seed, its
        position): the chosen rows' prompts, with the generator's first_row at the first chosen position and
        unchosen rows between them filled by a repeat of a chosen prompt whose completion is dropped."""
        seed, generator = self.seed * SEED_STRIDE + step, self.generators[source]
        if not chosen:
            generator.generate([], seed=seed, first_row=first_row)
            return []
        span = range(chosen[0], chosen[-1] + 1)
        by_row = dict(zip(chosen, prompts))
        rows = [by_row.get(i, prompts[0]) for i in span]
        out = generator.generate(rows, seed=seed, first_row=first_row + chosen[0])
        return [out[i - chosen[0]] for i in chosen]
