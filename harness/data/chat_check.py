"""Chat records checked before any rank trains: the head of each local file rendered by the tokenizer's chat
template as it will train (harness/data/chat_template.py), so a record the template cannot train is refused with
its file and line before the process group exists, not minutes later from the store's build."""

from __future__ import annotations

from harness.data.chat_template import documents, explain
from harness.data.files import head_records
from harness.data.formats import chat_record, record_problem
from harness.errors import UsageError

RENDER_BUDGET = 1000  # records rendered before launch in all: each file's head, fewer per file past 10 files


def check_chat_head(spec, tokenizer) -> tuple[int, int]:
    """Before any rank trains: the first records of each local file (builtin included; at most RENDER_BUDGET in
    all, at least one per file) rendered as they will train, so a record the chat template cannot train is refused (UsageError: the file, the line, the template's
    error, the fix). Returns (records checked, records that are more than one document: a template that rewrites
    history). The store's build renders every record again (a problem past the head is named by its number)."""

    checked = split = 0
    heads = head_records(spec)
    per_file = max(1, RENDER_BUDGET // max(1, len(heads)))  # a template renders a record in ~1-10 ms
    for path, wheres, records in heads:
        for where, record in zip(wheres[:per_file], records[:per_file]):
            if record_problem(spec, record):
                continue  # a malformed sharegpt record: check_local names it
            try:
                _, whole = documents(tokenizer, *chat_record(spec, record), spec.chat_turns)
            except Exception as e:  # the template's own error or a RenderProblem
                what, fix = explain(e)
                raise UsageError(f"data file {path} {where} is not a chat record the tokenizer's template can train "
                                 f"(train.format {spec.format!r}): {what}\n    fix: {fix}") from None
            checked += 1
            split += not whole
    return checked, split
