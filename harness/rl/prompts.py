"""The prompt set of an RL run (train.objective grpo), as TRL reads one: the prompt column (train.prompt_field,
TRL's "prompt") holds a string, or a list of {role, content} messages that the tokenizer's chat template renders
with the generation prompt; every other column is handed to the reward functions as a keyword argument, one value
per completion. train.dataset builtin is the toy task of harness/rl/toy.py.

A string prompt is tokenized as TRL does (the tokenizer's own special tokens). A prompt longer than
rl.max_prompt_length tokens is dropped and counted in the start-up lines (rl.truncation drop) or refuses the run
(refuse), naming the record. A missing prompt column refuses the run before any rank trains.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from harness.errors import UsageError


@dataclass
class PromptRows:
    """Rows of a prompt set as the trainer's probe reads them: .tensors() -> (padded prompt ids,)."""

    token_ids: list[list[int]]
    pad_id: int = 0

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.token_ids), max((len(p) for p in self.token_ids), default=0)

    def __getitem__(self, rows):
        return PromptRows(self.token_ids[rows] if isinstance(rows, slice) else [self.token_ids[int(i)] for i in rows],
                          self.pad_id)

    def tensors(self) -> tuple[torch.Tensor]:
        out = torch.full(self.shape, self.pad_id, dtype=torch.long)
        for i, ids in enumerate(self.token_ids):
            out[i, :len(ids)] = torch.tensor(ids)
        return (out,)


@dataclass
class Prompts(PromptRows):
    values: list = field(default_factory=list)  # the prompts as given (text or messages), for the rewards
    columns: dict = field(default_factory=dict)  # every other column: {name: [value per prompt]}
    records: list[int] = field(default_factory=list)  # each prompt's record number in the dataset
    dropped: int = 0  # prompts over rl.max_prompt_length (rl.truncation drop)
    toolbox: object = None  # multi-turn runs: harness/rl/tools.Toolbox (the prompts are rendered with its tools)


def read_records(dataset: str, split: str = "train", config: str = "") -> tuple[list[dict], str]:
    """(records, where) of train.dataset: builtin, a local .jsonl / .json file, or anything `datasets` loads."""
    if dataset == "builtin":
        from harness.rl import toy

        return toy.records(), "the built-in toy task (harness/rl/toy.py)"
    path = Path(dataset).expanduser()
    if path.is_file() and path.suffix in (".jsonl", ".json"):
        text = path.read_text()
        if path.suffix == ".json" and text.lstrip().startswith("["):
            return json.loads(text), str(path)
        out = []
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise UsageError(f"{path}:{number}: not JSON ({e.msg}): {line[:80]}\n    fix: one JSON object "
                                     "per line") from None
        return out, str(path)
    import datasets

    data = datasets.load_dataset(dataset, config or None, split=split)
    return [dict(r) for r in data], dataset


def encode(tokenizer, prompt, where: str, field_name: str, tools: list | None = None,
           template_kwargs: dict | None = None) -> list[int]:
    """A prompt's ids: a text tokenized, or messages rendered with the generation prompt (and the row's tool
    schemas, rl.chat_template_kwargs)."""
    if isinstance(prompt, str) and tools:
        raise UsageError(f"{where}: {field_name} is a text, and rl.tools / rl.environment_factory need a "
                         "conversation (tool results are messages, as TRL's)\n    fix: write the prompt as "
                         "[{\"role\": \"user\", \"content\": ...}]")
    if isinstance(prompt, str):
        return list(tokenizer(prompt)["input_ids"])
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "role" in m for m in prompt):
        if not getattr(tokenizer, "chat_template", None):
            raise UsageError(f"{where}: {field_name} holds messages but the tokenizer has no chat template\n    fix: "
                             "a model whose tokenizer has one, or text prompts")
        return list(tokenizer.apply_chat_template(prompt, tools=tools or None, add_generation_prompt=True,
                                                  tokenize=True, return_dict=True,
                                                  **(template_kwargs or {}))["input_ids"])
    raise UsageError(f"{where}: {field_name} is {str(prompt)[:80]!r}, neither a text nor a list of {{role, content}} "
                     "messages\n    fix: fix or drop the record")


def load(train: dict, rl: dict, tokenizer, toolbox=None) -> Prompts:
    """The run's prompts, every one checked and tokenized (with its tools' schemas when toolbox is given)."""
    records, where = read_records(train["dataset"], train.get("dataset_split", "train"),
                                  train.get("dataset_config", ""))
    name, limit = train.get("prompt_field", "prompt"), rl["max_prompt_length"]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out, kept = Prompts([], pad, toolbox=toolbox), []
    for number, record in enumerate(records, 1):
        if not isinstance(record, dict) or name not in record:
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise UsageError(f"{where}: record {number} has no prompt column {name!r} (it has {keys})\n    fix: name "
                             f"the column {name!r}, or set train.prompt_field to the column that holds the prompt")
        here = f"{where}: record {number}"
        schemas = None
        if toolbox is not None:
            schemas = toolbox.schemas[toolbox.env_name({k: [record.get(k)] for k in record}, 0, here)]
        ids = encode(tokenizer, record[name], here, name, schemas, rl.get("chat_template_kwargs"))
        if len(ids) > limit:
            if rl["truncation"] == "refuse":
                raise UsageError(f"{where}: record {number}'s prompt is {len(ids)} tokens, over rl.max_prompt_length "
                                 f"{limit}\n    fix: raise rl.max_prompt_length, or set rl.truncation=drop to leave "
                                 "such prompts out (counted)")
            out.dropped += 1
            continue
        out.token_ids.append(ids)
        out.values.append(record[name])
        out.records.append(number - 1)
        kept.append(record)
    keys = dict.fromkeys(k for r in kept for k in r if k != name)  # a column a record lacks: None there, as datasets
    out.columns = {k: [r.get(k) for r in kept] for k in keys}
    if not out.token_ids:
        raise UsageError(f"{where}: no prompt of at most rl.max_prompt_length {limit} tokens ({out.dropped} longer)"
                         "\n    fix: raise rl.max_prompt_length")
    return out
