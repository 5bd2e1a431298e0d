"""On-policy completions of a gkd run (distill.lmbda > 0), through the RL generators as they stand
(harness/rl/generation: HF generate on the live weights, ZeRO-3 gathers bounded by the planner; vLLM on GPU).

TRL's GKDTrainer draws one coin per micro-batch and process: with probability lmbda the student generates the
micro-batch's completions. Here the coin is drawn per ROW, from the stream (seed of the step, the row's position in
the step's global batch), and so is the row's completion (the generators' RowSampler): a step's completions and
losses are the same on any world size and accumulation, and a resumed run continues the uninterrupted one exactly.
The expected share of on-policy completions is lmbda, as TRL's. Every rank calls the generator once per
micro-batch (a collective under ZeRO-3), whether or not any of its rows drew on-policy.

A row drawn on-policy keeps its prompt and gets the student's completion (at
most distill.max_new_tokens tokens, sampled at distill.temperature, EOS included when generated), cut at
train.seq_len; its labels are the new completion's tokens.
"""

from __future__ import annotations

import torch

from harness.config.distill_rules import settings
from harness.data.rows import IGNORE_INDEX
from harness.rl.generation.sampling import row_seed

SEED_STRIDE = 1000003  # the step's seed: train.seed x this + the step (as the RL loop's)


class OnPolicy:
    def __init__(self, spec, engine):
        from harness.model.hf import load_tokenizer
        from harness.rl.generation import make_generator

        cfg = settings(spec.recipe)
        self.lmbda, self.seed = cfg["lmbda"], spec.recipe["train"]["seed"]
        tokenizer = load_tokenizer(spec.recipe["train"]["model"])
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        rl = {"generator": "hf", "max_completion_length": cfg["max_new_tokens"] or cfg["max_completion_length"],
              "temperature": cfg["temperature"], "top_k": 0, "top_p": 1.0}
        self.generator = make_generator(rl, engine, tokenizer, spec.run)

    def draws(self, step: int, first_row: int, rows: int) -> list[bool]:
        """Per row: whether its completion is the student's (its own stream, independent of the batching)."""
        seed = self.seed * SEED_STRIDE + step
        return [torch.rand(1, generator=torch.Generator().manual_seed(row_seed(seed, first_row + i)),
                           dtype=torch.float64).item() < self.lmbda for i in range(rows)]

    def batch(self, step: int, first_row: int, batch: tuple[torch.Tensor, ...]) -> tuple[tuple[torch.Tensor, ...],
                                                                                       list[int]]:
        """(the micro-batch with its drawn rows' completions generated and a 5th tensor: [B] bool, the row's completion
        is the student's (after the prompt lengths and the record numbers: harness/train/distill.py); their
        lengths)."""
        input_ids, labels = batch[0].clone(), batch[1].clone()
        chosen = [i for i, yes in enumerate(self.draws(step, first_row, input_ids.shape[0])) if yes]
        starts = [int(batch[2][i]) for i in chosen]  # the prompt lengths (harness/train/distill_data.py)
        prompts = [input_ids[i, :start].tolist() for i, start in zip(chosen, starts)]
        completions = self._generate(step, first_row, chosen, prompts)
        width = input_ids.shape[1]
        for i, start, completion in zip(chosen, starts, completions):
            row = (input_ids[i, :start].tolist() + completion)[:width]
            input_ids[i] = self.pad_id
            input_ids[i, :len(row)] = torch.tensor(row)
            labels[i] = IGNORE_INDEX
            labels[i, start:len(row)] = input_ids[i, start:len(row)]
        generated = torch.zeros(input_ids.shape[0], dtype=torch.bool)
        generated[chosen] = True
        return (input_ids, labels, *batch[2:4], generated), [len(c) for c in completions]

    def _generate(self, step: int, first_row: int, chosen: list[int], prompts: list) -> list[list[int]]:
        """One generate call per micro-batch (collective), every row drawing from (step seed, its position): the
        chosen rows' prompts, with the generator's first_row at the first chosen position and unchosen rows
        between them filled by a repeat of a chosen prompt whose completion is dropped."""
        seed = self.seed * SEED_STRIDE + step
        if not chosen:
            self.generator.generate([], seed=seed, first_row=first_row)
            return []
        span = range(chosen[0], chosen[-1] + 1)
        by_row = dict(zip(chosen, prompts))
        rows = [by_row.get(i, prompts[0]) for i in span]
        out = self.generator.generate(rows, seed=seed, first_row=first_row + chosen[0])
        return [out[i - chosen[0]] for i in chosen]
