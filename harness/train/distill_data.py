"""The records of a distillation run: TRL's prompt-completion form (train.objective gkd), or its prompts alone
(distill, whose completions are all the student's own), one record per row.

A record holds the prompt (train.prompt_field, TRL's "prompt") and its `completion`, both texts or both lists of
{role, content} messages, tokenized as TRL does (harness/data/preference_records.encode_completions: the prompt's
ids, then the completion's, then eos; messages through the chat template). train.dataset builtin is the built-in
preference set (harness/assets/preference.jsonl) with each record's chosen answer as its completion: 200 short
question / answer records, no network.

A row is the prompt and the completion, cut at train.seq_len (the completion from its end), right-padded; labels
are -100 on the prompt and the padding. `Completions` quacks like harness/data/rows.Rows (shape, a view per
selection, tensors()), so the batch plan, the train/eval split and the data checks work unchanged. The rows are
tokenized on every rank at start-up and held in memory (int32, seq_len per record): the set is read once per run.
"""

from __future__ import annotations

import numpy as np
import torch

from harness.data.corpus import COMPLETION_COLUMN, DataSpec
from harness.data.rows import IGNORE_INDEX, split_rows
from harness.errors import UsageError


class Completions:
    def __init__(self, tokens: np.ndarray, bounds: np.ndarray, index: np.ndarray):
        """tokens: int32 [records, seq_len] padded rows; bounds: int32 [records, 2] (prompt length, row length)."""
        self.tokens, self.bounds, self.index = tokens, bounds, index

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self.index), self.tokens.shape[1])

    def __len__(self) -> int:
        return len(self.index)

    @property
    def ids(self) -> torch.Tensor:
        """[n] int64 record numbers, the keys of the precomputed teacher store's rows (harness/distill/
        teacher_store.py); the trainer's fetch appends them to the batch after tensors()' three."""
        return torch.from_numpy(self.index)

    def every_record(self) -> "Completions":
        """Every record of the set (the train and eval splits together), in record order."""
        return Completions(self.tokens, self.bounds, np.arange(len(self.tokens), dtype=np.int64))

    def __getitem__(self, sel) -> "Completions":
        if torch.is_tensor(sel):
            sel = sel.numpy()
        return Completions(self.tokens, self.bounds, self.index[sel])

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input_ids, labels, prompt lengths): LongTensors [n, seq_len], [n, seq_len], [n]; labels are the ids on
        the completion (and its eos) only (none for a prompt-only record: objective distill)."""
        ids = torch.from_numpy(self.tokens[self.index].astype(np.int64))
        bounds = torch.from_numpy(self.bounds[self.index].astype(np.int64))
        where = torch.arange(ids.shape[1])
        target = (where >= bounds[:, :1]) & (where < bounds[:, 1:])
        return ids, ids.masked_fill(~target, IGNORE_INDEX), bounds[:, 0]


def _record_pair(record, number: int, where: str, prompt_field: str, builtin: bool, prompts_only: bool) -> tuple:
    completion_field = "chosen" if builtin else COMPLETION_COLUMN
    if prompts_only and isinstance(record, dict) and prompt_field in record:  # objective distill: TRL's prompts
        prompt = record[prompt_field]
        return prompt, ([] if isinstance(prompt, list) else "")
    if not isinstance(record, dict) or prompt_field not in record or completion_field not in record:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise UsageError(f"{where}: record {number} has no {prompt_field!r} and {COMPLETION_COLUMN!r} columns (it "
                         f"has {keys})\n    fix: write TRL's prompt-completion records ({{\"prompt\": ..., "
                         "\"completion\": ...}}), or set train.prompt_field to the prompt's column")
    prompt, completion = record[prompt_field], record[completion_field]
    if isinstance(prompt, list) != isinstance(completion, list) or not isinstance(completion, (str, list)):
        raise UsageError(f"{where}: record {number}: the prompt is a {type(prompt).__name__} and the completion a "
                         f"{type(completion).__name__}\n    fix: both texts or both lists of {{role, content}} "
                         "messages")
    return prompt, completion


def encode_records(records: list, where: str, tokenizer, seq_len: int, prompt_field: str = "prompt",
                   builtin: bool = False, prompts_only: bool = False) -> tuple[Completions, dict]:
    """(every record as a row, counts {records, truncated}); a prompt that fills seq_len is refused, naming it.
    prompts_only (objective distill): the prompt alone, no labels (the student generates every completion)."""
    from harness.data.preference_records import encode_completions
    from harness.rl.prompts import encode

    items = [_record_pair(r, n, where, prompt_field, builtin, prompts_only) for n, r in enumerate(records, 1)]
    if not items:
        raise UsageError(f"{where}: no records\n    fix: a dataset of prompt-completion records")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = np.full((len(items), seq_len), pad, dtype=np.int32)
    bounds = np.zeros((len(items), 2), dtype=np.int32)
    truncated = 0
    encoded = [(encode(tokenizer, p, where, prompt_field), [], False) for p, _ in items] if prompts_only else \
        encode_completions(tokenizer, items)
    for n, (prompt, completion, _) in enumerate(encoded):
        if len(prompt) >= seq_len:
            raise UsageError(f"{where}: record {n + 1}'s prompt is {len(prompt)} tokens, train.seq_len {seq_len}: no "
                             "room for a completion token\n    fix: raise train.seq_len above the longest prompt, or "
                             "shorten the prompt")
        row = (prompt + completion)[:seq_len]
        truncated += len(prompt) + len(completion) > seq_len
        ids[n, :len(row)] = row
        bounds[n] = (len(prompt), len(row))
    return Completions(ids, bounds, np.arange(len(items), dtype=np.int64)), {"records": len(items),
                                                                               "truncated": truncated}


def load_completions(spec, tokenizer) -> tuple[Completions, Completions, list[str]]:
    """(train, eval, start-up lines) of the run's records, split by train.eval_fraction as LM rows are."""
    import time

    from harness.data.corpus import BUILTIN, BUILTIN_PREFERENCE
    from harness.rl.prompts import read_records

    start, train = time.perf_counter(), spec.recipe["train"]
    data_spec = DataSpec.from_train(train)
    builtin = data_spec.dataset == BUILTIN
    if builtin:
        records, where = read_records(str(BUILTIN_PREFERENCE))
        where = f"the built-in set ({where}: prompt, chosen answer as the completion)"
    else:
        records, where = read_records(data_spec.dataset, data_spec.split, data_spec.config)
    prompts_only = train["objective"] == "distill"
    rows, counts = encode_records(records, where, tokenizer, train["seq_len"], data_spec.prompt_field, builtin,
                                  prompts_only)
    train_rows, eval_rows = split_rows(rows, train["eval_fraction"], train["seed"])
    kind = "prompts (the student generates every completion)" if prompts_only else "prompt-completion records"
    lines = [f"{where}: {counts['records']} {kind}, one per row of train.seq_len {train['seq_len']} "
             f"({counts['truncated']} completions cut at its end); data ready in {time.perf_counter() - start:.2f}s"]
    return train_rows, eval_rows, lines
