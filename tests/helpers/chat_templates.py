"""Real models' chat templates (tests/fixtures/chat_templates, source in SOURCE.md) on tiny tokenizers, and chat
records with tool calls and reasoning in Hugging Face's names."""

from __future__ import annotations

import copy
from pathlib import Path

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
# template -> (special tokens, plain added tokens, bos, eos) as the model's tokenizer has them
TOKENS = {
    "llama3_1": (["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                  "<|python_tag|>"], [], "<|begin_of_text|>", "<|eot_id|>"),
    "qwen2_5": (["<|im_start|>", "<|im_end|>"], ["<tool_call>", "</tool_call>"], "<|endoftext|>", "<|im_end|>"),
    "qwen3": (["<|im_start|>", "<|im_end|>"], ["<think>", "</think>", "<tool_call>", "</tool_call>",
                                                "<tool_response>", "</tool_response>"], "<|endoftext|>", "<|im_end|>"),
    "gemma3": (["<bos>", "<start_of_turn>", "<end_of_turn>", "<eos>"], [], "<bos>", "<eos>"),
}
TOKENS["qwen3_training"] = TOKENS["qwen3"]


def template_tokenizer(name: str):
    """The harness's byte-level BPE tokenizer with template `name` and the special tokens it writes."""
    from harness.model.hf import load_tokenizer

    special, plain, bos, eos = TOKENS[name]
    tok = load_tokenizer("tiny-llama")
    tok.add_special_tokens({"bos_token": bos, "eos_token": eos, "additional_special_tokens": special})
    tok.add_tokens(plain)
    tok.chat_template = (TEMPLATES / f"{name}.jinja").read_text()
    return tok


def _tool(name: str, properties: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": f"{name} tool",
                                             "parameters": {"type": "object", "properties": properties,
                                                            "required": list(properties)}}}


WEATHER = _tool("get_weather", {"city": {"type": "string", "description": "the city"}})
SEARCH = _tool("search", {"query": {"type": "string"}, "limit": {"type": "integer"}})


def call(name: str, **arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def tool_records(reasoning: bool) -> list[dict]:
    """Three records: two tool-use conversations with different tools (so datasets reads them into Arrow structs
    padded with nulls), one plain two-turn chat. reasoning: assistant turns carry reasoning_content (one carries
    <think> in its content instead)."""
    def think(text: str) -> dict:
        return {"reasoning_content": text} if reasoning else {}

    weather = [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call("get_weather", city="Paris")], **think("Call it.")},
        {"role": "tool", "content": "18 C"},
        {"role": "assistant", "content": "It is 18 C in Paris.", **think("The tool said 18.")},
        {"role": "user", "content": "And Rome?"},
        {"role": "assistant", "content": "", "tool_calls": [call("get_weather", city="Rome")], **think("Again.")},
        {"role": "tool", "content": "21 C"},
        {"role": "assistant", "content": "21 C in Rome.", **think("Rome is 21.")},
    ]
    search = [
        {"role": "user", "content": "Find dsharness."},
        {"role": "assistant", "content": "", "tool_calls": [call("search", query="dsharness", limit=3)]},
        {"role": "tool", "content": "3 results"},
        {"role": "assistant", "content": ("<think>\nThree found.\n</think>\n\n" if reasoning else "") + "Found 3."},
    ]
    plain = [{"role": "user", "content": "Sort: dog cat"}, {"role": "assistant", "content": "cat dog", **think("a-z")},
             {"role": "user", "content": "Sort: fish bird"}, {"role": "assistant", "content": "bird fish"}]
    return [{"messages": weather, "tools": [WEATHER]}, {"messages": search, "tools": [SEARCH]}, {"messages": plain}]


def plain_records() -> list[dict]:
    """Records without tools (Gemma 3's template has none): a system prompt, two turns."""
    return [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sort: b a"},
                          {"role": "assistant", "content": "a b"}, {"role": "user", "content": "Sort: d c"},
                          {"role": "assistant", "content": "c d"}]},
            {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}]


def expected_turns(tok, record: dict, turns: str = "all") -> list[tuple[list[int], list[int]]]:
    """(ids of messages[:i] + generation prompt, ids of messages[:i+1]) per trained assistant turn i, each from the
    template's own rendering tokenized whole (apply_chat_template, tokenize=True)."""
    messages, tools = copy.deepcopy(record["messages"]), record.get("tools")
    indices = [i for i, m in enumerate(messages) if m["role"] == "assistant"]

    def ids(msgs, gen=False):
        return tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=gen, tokenize=True,
                                       return_dict=True)["input_ids"]
    return [(ids(messages[:i], gen=True), ids(messages[:i + 1])) for i in (indices[-1:] if turns == "last" else indices)]


def write_tool_chat(path: Path, num: int, seed: int = 0) -> Path:
    """num records of tool use with reasoning and of plain two-turn chat, words varied (for a training run under
    Qwen3's template, which splits each of them into more than one sample)."""
    import json
    import random

    from helpers.corpora import WORDS

    rng = random.Random(seed)
    with open(path, "w") as f:
        for n in range(num):
            a, b = rng.sample(WORDS, 2)
            if n % 2:
                record = {"messages": [
                    {"role": "user", "content": f"Weather in {a}?"},
                    {"role": "assistant", "content": "", "reasoning_content": f"Ask the tool about {a}.",
                     "tool_calls": [call("get_weather", city=a)]},
                    {"role": "tool", "content": f"{b} sky"},
                    {"role": "assistant", "content": f"{a} has a {b} sky.", "reasoning_content": f"It said {b}."}],
                    "tools": [WEATHER]}
            else:
                record = {"messages": [
                    {"role": "user", "content": f"Sort: {a} {b}"},
                    {"role": "assistant", "content": " ".join(sorted((a, b))), "reasoning_content": "a-z"},
                    {"role": "user", "content": f"Reverse: {a} {b}"},
                    {"role": "assistant", "content": f"{b} {a}", "reasoning_content": "swap"}]}
            f.write(json.dumps(record) + "\n")
    return path
