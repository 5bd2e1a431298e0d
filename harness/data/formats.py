"""Records -> token ids and loss masks, per train.format.

text:        the text, then eos; every token carries loss (as plain language-model pre-training).
instruction: the prompt's tokens (no loss), then the response's tokens and eos (loss). Put any separator or
             prompt template into the prompt text itself: nothing is inserted between the two.
chat:        the tokenizer's chat template over a list of {role, content} messages. Only what the template
             renders for assistant turns carries loss; a conversation ends with eos (no loss: it only separates
             packed conversations). The template is rendered turn by turn, so each assistant turn's text is
             exactly what the full conversation renders after the generation prompt.

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


def check_chat_template(tokenizer, model: str = "") -> None:
    if getattr(tokenizer, "chat_template", None):
        return
    model = model or getattr(tokenizer, "name_or_path", "") or "(given)"
    raise UsageError(
        f"train.format is 'chat' but the tokenizer of model {model} has no chat template\n"
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


def chat_segments(tokenizer, messages: list[dict]) -> list[tuple[str, int]]:
    """(text, 1 for assistant output else 0) pieces whose concatenation is the rendered conversation."""
    def render(msgs, gen=False):
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen) if msgs else ""

    segments, done = [], ""
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        prefix, full = render(messages[:i], gen=True), render(messages[:i + 1])
        if not (prefix.startswith(done) and full.startswith(prefix)):
            raise UsageError("the tokenizer's chat template does not render a conversation as a prefix of its "
                             f"continuation (at message {i}), so assistant tokens cannot be located\n"
                             "    fix: use a template whose output for messages[:i] (+ generation prompt) is a "
                             "prefix of its output for messages[:i+1], or train.format=instruction")
        segments += [(prefix[len(done):], 0), (full[len(prefix):], 1)]
        done = full
    whole = render(messages)
    segments.append((whole[len(done):], 0))
    return [(text, loss) for text, loss in segments if text]


def encoder(spec, tokenizer):
    """A batched `datasets.map` function for spec.format (a picklable closure over the tokenizer)."""
    eos = _eos(tokenizer)
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
    check_chat_template(tokenizer)
    field = spec.messages_field

    def encode_chat(batch):
        docs = [chat_segments(tokenizer, list(messages or [])) for messages in batch[field]]
        return _encode_segments(tokenizer, docs, eos, eos_loss=0)
    return encode_chat
