"""Preference records -> (prompt, chosen, rejected) token ids, by TRL's rules (trl/trainer/dpo_trainer.py
`_prepare_dataset`, data_utils.py `extract_prompt`), so a pair here is the pair TRL's DPOTrainer trains on.

A record holds `chosen` and `rejected` (TRL's column names) and, optionally, its prompt (train.prompt_field):
    text          prompt, chosen and rejected strings. The eos token's text is appended to each completion
                  unless it already ends with it; prompt ids = tokenizer(prompt), each side's completion ids =
                  tokenizer(prompt + completion)[len(prompt ids):] (the tokenizer's own special tokens, as TRL).
    messages      prompt, chosen and rejected lists of {role, content}: prompt ids = the chat template over the
                  prompt with the generation prompt; a side's completion = the template over prompt + completion,
                  past the prompt's ids (the template ends the turn; no eos is added).
    implicit      no prompt (or a prompt of the other kind, as UltraFeedback's string `prompt` beside message
                  lists): chosen and rejected are whole conversations (or texts); their common prefix is the prompt
                  (extract_prompt: whole messages; for text, the characters, less a space it ends on).
Where the prompt's ids are not a prefix of prompt + completion's (a tokenizer merging across the join), TRL warns
and keeps prompt ids + the tail; so does this, counting them (`mismatched`).

A pair is then fitted to seq_len (fit_pair): the prompt is kept whole; completions longer than the room left are
cut at the end (truncate) or the pair is left out (drop, counted). A prompt of seq_len tokens or more leaves no
room for a completion token: refused under truncate (exit 2), counted and left out under drop.
"""

from __future__ import annotations

from harness.data.corpus import PAIR_COLUMNS
from harness.errors import UsageError

TRUNCATIONS = ("truncate", "drop")  # preference.truncation; the schema's default is the first


def pair_fix(prompt_field: str = "prompt") -> str:
    return (f"each preference record needs {' and '.join(repr(c) for c in PAIR_COLUMNS)}: non-empty texts with a "
            f"{prompt_field!r} text (train.prompt_field), or lists of {{\"role\", \"content\"}} messages with a "
            f"{prompt_field!r} message list, or whole conversations that share their first messages (the prompt); "
            "fix or drop the record")


def _messages_problem(value: list) -> str | None:
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            return f"message {i} is a {type(message).__name__}, not an object"
        if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
            return f"message {i} has role={message.get('role')!r}, content={str(message.get('content'))[:40]!r}, " \
                   "not text for both"
    return None


def _kind(value) -> str:
    return "nothing" if value is None else ("message list" if isinstance(value, list) else type(value).__name__)


def _common_prefix(chosen, rejected) -> int:
    """How many leading items (messages, or characters) both share; for text, less a space it would end on."""
    n = 0
    for a, b in zip(chosen, rejected):
        if a != b:
            break
        n += 1
    if isinstance(chosen, str) and n and n < min(len(chosen), len(rejected)) and chosen[n - 1] == " ":
        n -= 1  # extract_prompt: the space before the completions starts them, as in " It is blue."
    return n


def split_pair(record: dict, prompt_field: str = "prompt") -> tuple:
    """(prompt, chosen, rejected) of a well-formed record (pair_problem None): the record's own prompt when it is
    of the completions' kind, else the completions' common prefix (TRL's maybe_extract_prompt)."""
    chosen, rejected = record[PAIR_COLUMNS[0]], record[PAIR_COLUMNS[1]]
    prompt = record.get(prompt_field)
    if prompt is not None and isinstance(prompt, list) == isinstance(chosen, list):
        return prompt, chosen, rejected
    n = _common_prefix(chosen, rejected)
    return chosen[:n], chosen[n:], rejected[n:]


def _empty(completion) -> bool:
    if isinstance(completion, str):
        return not completion.strip()
    return not any(m["content"].strip() for m in completion)


def pair_problem(record: dict, prompt_field: str = "prompt") -> str | None:
    """What is wrong with one preference record, in words (None when it can be tokenized)."""
    chosen, rejected = (record.get(c) for c in PAIR_COLUMNS)
    for name, value in zip(PAIR_COLUMNS, (chosen, rejected)):
        if value is None:
            held = [key for key, v in record.items() if v is not None]  # `datasets` fills a missing key with None
            return f"has no {name!r} (its keys: {', '.join(held) or '(none)'})"
        if not isinstance(value, (str, list)):
            return f"{name!r} is a {type(value).__name__} ({str(value)[:40]!r}), not text or a list of messages"
        if isinstance(value, list) and (problem := _messages_problem(value)):
            return f"{name!r} {problem}"
    if isinstance(chosen, list) != isinstance(rejected, list):
        return f"'chosen' is a {_kind(chosen)} and 'rejected' a {_kind(rejected)}: both must be text or both messages"
    prompt = record.get(prompt_field)
    if isinstance(prompt, list) and (problem := _messages_problem(prompt)):
        return f"{prompt_field!r} {problem}"
    if prompt is not None and not isinstance(prompt, (str, list)):
        return f"{prompt_field!r} is a {type(prompt).__name__}, not text or a list of messages"
    own_prompt = prompt is not None and isinstance(prompt, list) == isinstance(chosen, list)
    head, chosen_part, rejected_part = split_pair(record, prompt_field)
    if not own_prompt and isinstance(chosen, list) and not head:
        return (f"has no {prompt_field!r} of its kind, and its 'chosen' and 'rejected' message lists share no "
                f"first message to take as the prompt (chosen starts {str(chosen[:1])[:60]}, rejected "
                f"{str(rejected[:1])[:60]})")
    for name, part in zip(PAIR_COLUMNS, (chosen_part, rejected_part)):
        if _empty(part):
            return f"has an empty {name!r} completion ({str(part)[:60]!r} after the prompt)"
    return None


def check_pair_template(tokenizer, where: str = "a preference record") -> None:
    if getattr(tokenizer, "chat_template", None):
        return
    model = getattr(tokenizer, "name_or_path", "") or "(the run's)"
    raise UsageError(f"{where} holds message lists but the tokenizer of model {model} has no chat "
                     "template to render them\n    fix: use a model whose tokenizer_config.json (or chat_template.jinja) "
                     "defines one (tokenizer.chat_template = '<jinja>'; tokenizer.save_pretrained(model_dir)), or "
                     "write the records as prompt/chosen/rejected texts")


def _chat_ids(tokenizer, messages: list, generation: bool = False) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation, return_dict=True)
    return list(out["input_ids"])


def encode_completions(tokenizer, items: list[tuple]) -> list[tuple[list[int], list[int], bool]]:
    """(prompt ids, completion ids, mismatched) per (prompt, completion), by TRL's rules: a text completion gets the
    eos token's text unless it ends with it, its ids are tokenizer(prompt + completion)[len(prompt ids):]; a message
    list's are the chat template over prompt + completion past the prompt's ids (with the generation prompt)."""
    eos = tokenizer.eos_token
    if eos is None and any(isinstance(item[1], str) for item in items):
        raise UsageError("the tokenizer has no eos token to end each text completion with (TRL's rule)\n    fix: use "
                         "a tokenizer with an eos token, or write the records as message lists (the chat template "
                         "ends each turn)")
    flat = [t for p, c in items if isinstance(c, str) for t in (p, p + (c if c.endswith(eos) else c + eos))]
    text_ids = iter(tokenizer(flat)["input_ids"]) if flat else iter(())
    out = []
    for prompt, completion in items:
        if isinstance(completion, str):
            p, pc = next(text_ids), next(text_ids)
        else:
            check_pair_template(tokenizer)
            p, pc = _chat_ids(tokenizer, prompt, generation=True), _chat_ids(tokenizer, prompt + completion)
        p = list(p)
        out.append((p, list(pc[len(p):]), list(pc[:len(p)]) != p))
    return out


def encode_pairs(tokenizer, pairs: list[tuple]) -> list[tuple[list[int], list[int], list[int], bool]]:
    """(prompt ids, chosen completion ids, rejected completion ids, mismatched) per (prompt, chosen, rejected)."""
    sides = encode_completions(tokenizer, [(p, side) for p, c, r in pairs for side in (c, r)])
    return [(chosen[0], chosen[1], rejected[1], chosen[2] or rejected[2])
            for chosen, rejected in zip(sides[0::2], sides[1::2])]


def fit_pair(prompt: list[int], chosen: list[int], rejected: list[int], seq_len: int,
             truncation: str) -> tuple[tuple | None, str]:
    """((prompt, chosen, rejected) cut to seq_len, or None when left out; what happened): "fits", "truncated",
    "long" (dropped: a completion past seq_len under drop), "prompt" (the prompt fills seq_len)."""
    if truncation not in TRUNCATIONS:
        raise ValueError(f"truncation must be one of {TRUNCATIONS}, got {truncation!r}")
    room = seq_len - len(prompt)
    if room < 1:
        return None, "prompt"
    if len(chosen) <= room and len(rejected) <= room:
        return (prompt, chosen, rejected), "fits"
    if truncation == "drop":
        return None, "long"
    return (prompt, chosen[:room], rejected[:room]), "truncated"


def prompt_fills(where: str, prompt_len: int, seq_len: int) -> UsageError:
    return UsageError(f"{where}: its prompt is {prompt_len} tokens, train.seq_len {seq_len}: no room for a single "
                      "completion token\n    fix: raise train.seq_len above the longest prompt, shorten the prompt, "
                      "or set preference.truncation=drop to leave such pairs out (counted at start-up)")


def empty_after_tokens(where: str, name: str) -> UsageError:
    return UsageError(f"{where}: its {name!r} completion has no tokens after the prompt's (the chat template "
                      f"renders nothing for it)\n    fix: {pair_fix()}")
