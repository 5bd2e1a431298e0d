"""The chat template's side of a multi-turn rollout, token-in/token-out as TRL builds it (huggingface/trl#5242):

- a later turn's input is prompt_ids + the completion so far (the ids sampled, never re-tokenized: BPE is not a
  bijection, trl#5224) + the tool suffix ids: the template rendered for a minimal conversation with and without the
  tool messages (the real tool name, TRL's dummy), the first cut after its last EOS, the difference taken;
- the prefix invariant, checked before launch on the template (`problems`) and on every suffix: the rendering
  without the tool messages must be a prefix of the rendering with them, or the turn ends the run naming the row;
- a turn's tool calls parsed from its ids: the tokenizer's own `response_template` when it has one (transformers'
  parse_response, TRL's first choice), else Hermes-style `<tool_call>{"name": .., "arguments": {..}}</tool_call>`
  blocks (Qwen2.5, Qwen3, Hermes templates render these); a malformed call is plain text (TRL's fallback).
"""

from __future__ import annotations

import json
import re

from harness.errors import Problem

CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
SENTINELS = ("tool_name_a8f3", "tool_arg_key_b9d4", "tool_arg_val_d6e7", "tool_content_c4f9")


def render(tokenizer, messages: list[dict], *, tools=None, generation_prompt: bool, kwargs: dict) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt,
                                              tokenize=True, return_dict=True, **kwargs)["input_ids"])


def _dummy(name: str) -> list[dict]:
    return [{"role": "user", "content": "dummy"},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
                "name": name, "arguments": {}}}]}]


def suffix_ids(tokenizer, tool_messages: list[dict], kwargs: dict) -> list[int] | None:
    """The tokens between an assistant turn's EOS and the next turn's first sampled token; None when the rendering
    without the tool messages is not a prefix of the one with them (the template rewrites earlier turns)."""
    head = _dummy(tool_messages[0]["name"])
    prefix = render(tokenizer, head, generation_prompt=False, kwargs=kwargs)
    full = render(tokenizer, head + tool_messages, generation_prompt=True, kwargs=kwargs)
    eos = [i for i, t in enumerate(prefix) if t == tokenizer.eos_token_id]
    if eos:  # templates that write "<|im_end|>\n": the turn the model sampled ends at its EOS
        prefix = prefix[:eos[-1] + 1]
    return full[len(prefix):] if full[:len(prefix)] == prefix else None


def problems(tokenizer, kwargs: dict) -> list[Problem]:
    """Before launch: the template renders a whole tool exchange, keeps earlier turns as they were, and its tool
    calls can be parsed."""
    if not getattr(tokenizer, "chat_template", None):
        return [Problem("rl.tools", "the tokenizer has no chat template: a tool exchange cannot be rendered",
                        "use a model whose tokenizer has a tool-calling chat template (Qwen2.5, Qwen3, Llama 3.1)")]
    name, key, value, content = SENTINELS
    exchange = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
                    "name": name, "arguments": {key: value}}}]},
                {"role": "tool", "name": name, "content": content}]
    try:
        text = tokenizer.apply_chat_template(exchange, tokenize=False, **kwargs)
    except Exception as err:  # noqa: BLE001 - jinja's TemplateError and kin: the template refuses the roles
        text = f"{type(err).__name__}: {err}"
    if not all(s in text for s in SENTINELS):
        return [Problem("rl.tools", "the chat template does not render a tool exchange (user -> assistant with "
                        f"tool_calls -> tool): {text[:160]!r}", "use a model whose template supports tool calling "
                        "(TRL refuses such a template too)")]
    out = []
    if suffix_ids(tokenizer, [{"role": "tool", "name": "dummy", "content": "dummy"}], kwargs) is None:
        out.append(Problem("rl.tools", "the chat template is not prefix-preserving: rendered with a tool result after "
                           "it, an assistant turn's tokens change (e.g. earlier <think> blocks dropped), so the "
                           "tokens sampled would not be the tokens trained", "set the tokenizer's chat_template to a "
                           "training template that keeps earlier turns (TRL's get_training_chat_template swaps one "
                           "in for known families; the harness does not)"))
    if getattr(tokenizer, "response_template", None) is None and "<tool_call>" not in text:
        out.append(Problem("rl.tools", "the template's tool calls are not Hermes-style <tool_call> JSON blocks and the "
                           "tokenizer has no response_template to parse them", "set tokenizer.response_template "
                           "(transformers' response parsing), or use a Qwen2.5 / Qwen3 / Hermes template"))
    return out


def parse(tokenizer, ids: list[int], prefix: list[int]) -> dict:
    """The assistant message of one turn: {"role": "assistant", "content": str[, "tool_calls": [...]]}."""
    if getattr(tokenizer, "response_template", None) is not None:
        try:
            parsed = tokenizer.parse_response(ids, prefix=prefix)
            if isinstance(parsed, dict):
                return _normal(parsed, tokenizer)
        except (ValueError, TypeError):
            pass
        return {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}
    text = tokenizer.decode(ids, skip_special_tokens=False)
    if tokenizer.eos_token:
        text = text.removesuffix(tokenizer.eos_token)
    calls = []
    for block in CALL.findall(text):
        try:
            call = json.loads(block)
        except json.JSONDecodeError:
            call = None
        arguments = call.get("arguments", {}) if isinstance(call, dict) else None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or \
                not isinstance(arguments if arguments is not None else {}, dict):
            return {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}
        calls.append({"type": "function", "function": {"name": call["name"], "arguments": arguments or {}}})
    message = {"role": "assistant", "content": CALL.sub("", text).strip()}
    if calls:
        message["tool_calls"] = calls
    return message


def _normal(parsed: dict, tokenizer) -> dict:
    content = parsed.get("content") or ""
    if isinstance(content, str) and tokenizer.eos_token:
        content = content.removesuffix(tokenizer.eos_token)
    out = {**parsed, "role": "assistant", "content": content}
    calls = [c for c in parsed.get("tool_calls") or [] if isinstance(c, dict)]
    for c in calls:
        fn = c.get("function", c)
        if fn.get("arguments") is None:
            fn["arguments"] = {}
    if calls:
        out["tool_calls"] = calls
    else:
        out.pop("tool_calls", None)
    return out
