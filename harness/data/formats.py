"""Records -> token ids and loss masks, per train.format.

text:        the text, then eos; every token carries loss (as plain language-model pre-training).
instruction: the prompt's tokens (no loss), then the response's tokens and eos (loss). Put any separator or
             prompt template into the prompt text itself: nothing is inserted between the two.
chat:        the tokenizer's chat template over HF chat records (messages with reasoning_content and tool_calls,
             tool messages, a tools list; harness/data/chat_template.py). Only what the template renders for
             assistant turns carries loss, each turn in the context the template gives it at inference (a record
             may be several documents under a template that rewrites history); each document ends with eos (no
             loss: it only separates packed conversations).
sharegpt:    chat from ShareGPT records: a list (train.conversations_field, default `conversations`) of
             {"from": human | gpt | system, "value": text}; human -> user, gpt -> assistant (carries loss),
             system -> system (first turn only), trained as chat (train.chat_turns too).
alpaca:      instruction from Alpaca records (train.instruction_field / input_field / output_field, default
             `instruction`, `input`, `output`; input optional): the prompt is Stanford Alpaca's template
             (ALPACA_PROMPT / ALPACA_PROMPT_NO_INPUT, no loss), the response the output and eos (loss). Each record
             is one document.
A malformed sharegpt/alpaca record is refused (record_problem): files.py names the file and line in the head it
checks before launch, the encoder names the record when tokenizing meets one further on.

An encoder maps a batch of records to {"input_ids": [[...]], "loss_mask": [[0/1...]]} (text: no loss_mask).
Segments are tokenized separately and concatenated, so a mask boundary is always a token boundary.
"""

from __future__ import annotations

from harness.errors import UsageError


def _eos(tokenizer) -> int:
    if tokenizer.eos_token_id is None:
        raise UsageError("the tokenizer has no eos token\n    fix: use a tokenizer with an eos token; "
                         "packing needs it to mark where each document ends")
    return tokenizer.eos_token_id


def check_chat_template(tokenizer, model: str = "", fmt: str = "chat") -> None:
    if getattr(tokenizer, "chat_template", None):
        return
    model = model or getattr(tokenizer, "name_or_path", "") or "(given)"
    raise UsageError(
        f"train.format is {fmt!r} but the tokenizer of model {model} has no chat template\n"
        "    fix: use a model whose tokenizer_config.json (or chat_template.jinja) defines one: set "
        "tokenizer.chat_template = '<jinja>' and tokenizer.save_pretrained(model_dir); or use "
        "train.format=instruction with prompt/response columns")


def _encode_segments(tokenizer, docs: list[list[tuple[str, int]]], eos: int, eos_loss: int) -> dict:
    """Tokenize every (text, loss) segment of every document in one call; join each document's pieces."""
    flat = [text for doc in docs for text, _ in doc]
    pieces = iter(tokenizer(flat, add_special_tokens=False)["input_ids"]) if flat else iter(())
    ids_out, mask_out = [], []
    for doc in docs:
        ids, mask = [], []
        for _, loss in doc:
            piece = next(pieces)
            ids += piece
            mask += [loss] * len(piece)
        if ids:  # an empty record adds nothing, not a lone eos
            ids.append(eos)
            mask.append(eos_loss)
        ids_out.append(ids)
        mask_out.append(mask)
    return {"input_ids": ids_out, "loss_mask": mask_out}


SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}
ALPACA_PROMPT = ("Below is an instruction that describes a task, paired with an input that provides further context. "
                 "Write a response that appropriately completes the request.\n\n"
                 "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
ALPACA_PROMPT_NO_INPUT = ("Below is an instruction that describes a task. Write a response that appropriately "
                          "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")
RECORD_FIX = {
    "sharegpt": 'each record\'s {field} must be a list of {{"from": "human" | "gpt" | "system", "value": "<text>"}} '
                "(system only first); fix or drop the record, or use train.format=chat with role/content messages",
    "alpaca": 'each record needs "{instruction}" (non-empty text) and "{output}" (text); "{input}" is optional text; '
              "fix or drop the record, or use train.format=instruction with train.prompt_field/response_field",
}


def _sharegpt_problem(turns) -> str | None:
    if not isinstance(turns, list) or not turns:
        return f"holds {type(turns).__name__ if turns is not None else 'nothing'} ({str(turns)[:60]!r}), not a " \
               "non-empty list of turns"
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            return f"turn {i} is a {type(turn).__name__}, not an object"
        if turn.get("from") not in SHAREGPT_ROLES:
            return f"turn {i} has from={turn.get('from')!r}, not one of {', '.join(SHAREGPT_ROLES)}"
        if not isinstance(turn.get("value"), str):
            return f"turn {i} ({turn['from']}) has value={turn.get('value')!r}, not text"
        if turn["from"] == "system" and i > 0:
            return f"turn {i} is a system turn after the first"
    return None


def _alpaca_problem(instruction, output, extra) -> str | None:
    if not isinstance(instruction, str) or not instruction.strip():
        return f"has instruction={instruction!r}, not non-empty text"
    if not isinstance(output, str):
        return f"has output={output!r}, not text"
    if extra is not None and not isinstance(extra, str):
        return f"has input={extra!r}, not text"
    return None


def record_problem(spec, record: dict) -> str | None:
    """What is wrong with one sharegpt/alpaca/preference record (None when it is well formed; other formats: None)."""
    if spec.preference:
        from harness.data.preference_records import pair_problem

        return pair_problem(record, spec.prompt_field)
    if spec.format == "sharegpt":
        problem = _sharegpt_problem(record.get(spec.conversations_field))
        return problem and f"{spec.conversations_field!r} {problem}"
    if spec.format == "alpaca":
        return _alpaca_problem(record.get(spec.instruction_field), record.get(spec.output_field),
                               record.get(spec.input_field))
    return None


def record_fix(spec) -> str:
    if spec.preference:
        from harness.data.preference_records import pair_fix

        return pair_fix(spec.prompt_field)
    return RECORD_FIX[spec.format].format(field=repr(spec.conversations_field), instruction=spec.instruction_field,
                                          output=spec.output_field, input=spec.input_field)


def _refuse_record(spec, number: int | None, record: dict, problem: str, fix: str = "") -> UsageError:
    shown = str(record)[:120]
    which = f"record {number + 1} (counting from 1 over the dataset's files)" if number is not None else "a record"
    return UsageError(f"dataset {spec.dataset!r}: {which} (train.format {spec.format!r}) {problem}: "
                      f"{shown}\n    fix: {fix or record_fix(spec)}")


def _checked(spec, batch: dict, indices) -> list[dict]:
    """The batch's records, each checked; indices: their numbers in the dataset (None when streamed)."""
    names = list(batch)
    records = [dict(zip(names, values)) for values in zip(*batch.values())]
    for offset, record in enumerate(records):
        if problem := record_problem(spec, record):
            raise _refuse_record(spec, indices[offset] if indices is not None else None, record, problem)
    return records


def sharegpt_messages(turns: list[dict]) -> list[dict]:
    return [{"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]} for t in turns]


def alpaca_prompt(instruction: str, extra: str | None) -> str:
    if extra and extra.strip():
        return ALPACA_PROMPT.format(instruction=instruction, input=extra)
    return ALPACA_PROMPT_NO_INPUT.format(instruction=instruction)


def _alpaca_encoder(spec, tokenizer, eos: int):
    """A map function with indices (so a bad record is named by its number)."""
    def encode_alpaca(batch, indices=None):
        docs = [[(alpaca_prompt(r[spec.instruction_field], r.get(spec.input_field)), 0),
                 (r[spec.output_field], 1)] for r in _checked(spec, batch, indices)]
        return _encode_segments(tokenizer, docs, eos, eos_loss=1)
    encode_alpaca.with_indices = True
    return encode_alpaca


def chat_record(spec, record: dict) -> tuple[list, list | None]:
    """(messages, tools) of a chat or sharegpt record, as the chat template takes them."""
    if spec.format == "sharegpt":
        return sharegpt_messages(record[spec.conversations_field]), None
    return record.get(spec.messages_field) or [], record.get(spec.tools_field)


def _chat_encoder(spec, tokenizer, eos: int):
    """chat / sharegpt: each record's documents (harness/data/chat_template.py), a refused record named by number."""
    from harness.data.chat_template import documents, explain

    check_chat_template(tokenizer, fmt=spec.format)

    def encode_chat(batch, indices=None):
        docs = []
        for offset, record in enumerate(_checked(spec, batch, indices)):
            try:
                docs += documents(tokenizer, *chat_record(spec, record), spec.chat_turns)[0]
            except Exception as e:  # the template's own error or a RenderProblem: refused, named
                what, fix = explain(e)
                raise _refuse_record(spec, indices[offset] if indices is not None else None, record, what,
                                     fix) from None
        return _encode_segments(tokenizer, docs, eos, eos_loss=0)
    encode_chat.with_indices = True
    return encode_chat


def encoder(spec, tokenizer):
    """A batched `datasets.map` function for spec.format (a picklable closure over the tokenizer)."""
    eos = _eos(tokenizer)
    if spec.uses_chat_template:
        return _chat_encoder(spec, tokenizer, eos)
    if spec.format == "alpaca":
        return _alpaca_encoder(spec, tokenizer, eos)
    if spec.format == "text":
        field = spec.text_field

        def encode_text(batch):
            ids = tokenizer([t or "" for t in batch[field]], add_special_tokens=False)["input_ids"]
            return {"input_ids": [row + [eos] if row else [] for row in ids]}
        return encode_text
    if spec.format == "instruction":
        prompt, response = spec.prompt_field, spec.response_field

        def encode_instruction(batch):
            docs = [[(p or "", 0), (r or "", 1)] for p, r in zip(batch[prompt], batch[response])]
            return _encode_segments(tokenizer, docs, eos, eos_loss=1)
        return encode_instruction
    raise UsageError(f"train.format {spec.format!r} has no encoder")

