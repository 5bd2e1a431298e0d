"""Chat records -> documents of (text, loss) pieces, rendered by the tokenizer's own chat template.

A record is Hugging Face's chat input: `messages` (role, content; an assistant message may carry
`reasoning_content` and `tool_calls` = [{"type": "function", "function": {"name", "arguments"}}]; `tool` role
messages carry the results) and an optional `tools` list of JSON schemas, passed to the template as
`apply_chat_template(messages, tools=tools)` would pass them.

What carries loss: each assistant turn's text exactly as the template renders it, and nothing else. A turn's text
is what the template renders for messages[:i+1] after its rendering of messages[:i] with the generation prompt,
i.e. what the model must generate at inference, end-of-turn token included (and whatever the template writes
after it before the next message, e.g. Qwen's "\\n" after <|im_end|>, as TRL's generation-marked templates count
it). A template with {% generation %} markers decides instead: the marked characters of that turn carry loss
(what HF's return_assistant_tokens_mask marks), except what the generation prompt already writes (a marked role
header is never generated).

Templates that rewrite history (Qwen3 drops the <think> block of turns before the last user message) render a
turn differently once later messages follow, so a conversation rendered once would train its earlier turns in a
context the model never sees (and diffing renderings prefix by prefix gives wrong masks: QwenLM/Qwen3#1522,
huggingface/trl#6361). Per record: a trained turn i is rendered as messages[:i+1] and goes into a document whose
text starts with that rendering, so its context is exactly the one it has at inference. With `chat_turns=all` the
first document is the whole conversation; for a prefix-stable template (Llama 3.1, Qwen2.5, Gemma 3) every turn
fits it and the record is one document, as before. Under Qwen3 the turns after the last user message fit it, and
each earlier group of turns (the turns between two user messages) gets a document of its own. `last` trains the
last assistant turn only: one document, messages[:last+1].

A record the template cannot render (it raises), renders without a field the record carries (reasoning_content,
a tool call's name, a tool's name: the template ignores it, so training would silently drop it), or whose turn
is not a continuation of its prompt is refused: `explain` says what, the callers say where.
"""

from __future__ import annotations

import re

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers passes the first found as all three
GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")  # as transformers detects it


class RenderProblem(ValueError):
    """A record the chat template cannot train (the message says why)."""


def without_nulls(value):
    """The value with every None-valued key dropped, at any depth. A parquet file (pyarrow, pandas, datasets
    before 5.0) holds records as Arrow structs whose fields are the union over the file, so a key one record lacks
    comes back as None (a message's `tool_calls`, a tool call's `arguments`, a tool schema's `properties`);
    templates test for keys, not values. An explicit null in the data is dropped alike (as transformers drops
    None-valued message keys)."""
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_nulls(v) for v in value]
    return value


def has_markers(tokenizer, tools=None) -> bool:
    template = tokenizer.get_chat_template(None, tools)
    return bool(GENERATION_MARKER.search(template))


def render(tokenizer, messages: list[dict], tools, gen: bool = False, markers: bool = False):
    """(text, generation spans or None): the template's rendering, as apply_chat_template(tokenize=False) gives it.
    markers: also the (start, end) characters inside {% generation %} blocks, as return_assistant_tokens_mask
    reads them."""
    if not messages:
        return "", []
    if not markers:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=gen), None
    from transformers.utils.chat_template_utils import render_jinja_template

    texts, spans = render_jinja_template(conversations=[messages], tools=tools, add_generation_prompt=gen,
                                         chat_template=tokenizer.get_chat_template(None, tools),
                                         return_assistant_tokens_mask=True, **tokenizer.special_tokens_map)
    return texts[0], [tuple(s) for s in spans[0]]


def _function(call: dict) -> dict:
    return call.get("function", call) if isinstance(call, dict) else {}


def _dropped(message: dict, turn: str) -> str | None:
    """A field of assistant message `message` that its rendered turn does not show."""
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    if isinstance(reasoning, str) and reasoning.strip() and reasoning.strip() not in turn:
        return ("renders without its reasoning_content (the template does not read it)", "put the reasoning into "
                "the content as <think>...</think> before the answer, or use a model whose template renders "
                "reasoning_content (e.g. Qwen3)")
    for call in message.get("tool_calls") or []:
        name = _function(call).get("name")
        if not isinstance(name, str) or name not in turn:
            return (f"renders without its tool call {name!r} (the template does not read tool_calls)",
                    "use a model whose template renders tool_calls (e.g. Llama 3.1, Qwen2.5, Qwen3), or write the "
                    "call into the content")
    return None


def _turn(tokenizer, messages, tools, i: int, markers: bool):
    """(text of messages[:i+1], [(start, end)] of assistant turn i in it) as the template renders them."""
    prompt, _ = render(tokenizer, messages[:i], tools, gen=True)
    full, marked = render(tokenizer, messages[:i + 1], tools, markers=markers)
    if not full.startswith(prompt):
        raise RenderProblem(f"message {i} (assistant): the template's rendering of messages[:{i + 1}] does not "
                            f"start with its rendering of messages[:{i}] plus the generation prompt, so the turn's "
                            "tokens cannot be located|use a template that renders a conversation as a continuation "
                            "of its generation prompt, or train.format=instruction")
    if dropped := _dropped(messages[i], full[len(prompt):]):
        raise RenderProblem(f"message {i} (assistant) {dropped[0]}|{dropped[1]}")
    if marked is None:
        return full, [(len(prompt), len(full))]
    return full, [(max(a, len(prompt)), b) for a, b in marked if b > len(prompt)]


def _check_tools(tools, text: str) -> None:
    for tool in tools or []:
        name = _function(tool).get("name")
        if isinstance(name, str) and name not in text:
            raise RenderProblem(f"its tool {name!r} does not appear in the rendering (the template does not read "
                                "tools)|use a model whose template renders tools (e.g. Llama 3.1, Qwen2.5, Qwen3), "
                                "or drop the tools column")


def _pieces(text: str, spans: list[tuple[int, int]]) -> list[tuple[str, int]]:
    """(text, loss) pieces of text, loss 1 inside the spans (sorted, disjoint)."""
    out, at = [], 0
    for start, end in spans:
        out += [(text[at:start], 0), (text[start:end], 1)]
        at = end
    out.append((text[at:], 0))
    return [(piece, loss) for piece, loss in out if piece]


def documents(tokenizer, messages: list[dict], tools=None, turns: str = "all") -> tuple[list, bool]:
    """(documents, rendered whole): each document a list of (text, loss) pieces whose concatenation is one rendering
    of the template. Each trained turn goes into the first document whose text starts with its own rendering
    (messages[:i+1]), so it is trained in its inference context; `all` starts from the whole conversation's
    rendering, and a turn that no document continues starts one of its own (turns between two user messages
    that a template like Qwen3's renders alike share one). Raises RenderProblem or the template's own error."""
    _shape_problem(messages, tools)
    messages, tools = without_nulls(list(messages)), without_nulls(tools) or None
    markers = has_markers(tokenizer, tools)
    # an assistant message that opens the conversation follows no generation prompt (no template renders an empty
    # conversation): it is context, like a system prompt
    assistants = [i for i, m in enumerate(messages) if m.get("role") == "assistant" and i > 0]
    if turns == "last":
        assistants = assistants[-1:]
    rendered = [_turn(tokenizer, messages, tools, i, markers) for i in assistants]
    docs = [(render(tokenizer, messages, tools)[0], [])] if turns == "all" and messages else []
    for text, spans in reversed(rendered):
        home = next((doc for doc in docs if doc[0].startswith(text)), None)
        if home is None:
            home = (text, [])
            docs.append(home)
        home[1].extend(spans)
    if docs:
        _check_tools(tools, docs[0][0])
    return [_pieces(text, sorted(spans)) for text, spans in reversed(docs)], len(docs) <= 1


def _shape_problem(messages, tools) -> None:
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise RenderProblem(f"holds {type(messages).__name__} ({str(messages)[:60]!r}), not a list of messages|each "
                            'record\'s messages must be a list of {"role": ..., "content": ...} objects')
    if tools is not None and not isinstance(tools, list):
        raise RenderProblem(f"has tools={str(tools)[:60]!r}, not a list of tool schemas|tools must be a list of "
                            '{"type": "function", "function": {"name", "description", "parameters"}}')


def explain(err: Exception) -> tuple[str, str]:
    """(what is wrong, the fix) for what `documents` raised on a record."""
    if isinstance(err, RenderProblem):
        what, _, fix = str(err).partition("|")
        return what, fix
    reason = str(err).splitlines()[0] if str(err) else ""  # jinja2's TemplateError (raise_exception), TypeError, ...
    return (f"cannot be rendered by the tokenizer's chat template ({type(err).__name__}: {reason})",
            "fix or drop the record so the template renders it (its roles, their order, its fields), or use a model "
            "whose chat template accepts it")
