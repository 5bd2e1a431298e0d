"""Chat with reasoning and tool calls, under the real chat templates of Llama 3.1, Qwen2.5, Qwen3 and Gemma 3 (tiny
tokenizers, tests/helpers/chat_templates.py): the tokens under loss are each assistant turn's tokens exactly as the
template renders them after its generation prompt, in the context the template gives the turn at inference, and
nothing else; a record the template cannot train is refused with its file, line and the template's error."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from helpers.chat_templates import (WEATHER, call, expected_turns, plain_records, template_tokenizer,  # noqa: E402
                                    tool_records)
from harness.data import files  # noqa: E402
from harness.data.chat_template import documents  # noqa: E402
from harness.data.corpus import DataSpec  # noqa: E402
from harness.data.chat_check import check_chat_head  # noqa: E402
from harness.data.store import prepare  # noqa: E402
from harness.errors import UsageError  # noqa: E402


def _jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _store_docs(store) -> list[tuple[list[int], list[int]]]:
    """(ids, loss mask) of every document in the store, without the eos that ends it (no loss)."""
    ids = np.fromfile(store.path / "tokens.bin", store.meta["dtype"]).astype(np.int64)
    mask = np.fromfile(store.path / "loss_mask.bin", np.uint8)
    ends = np.fromfile(store.path / "doc_index.bin", np.uint64).astype(np.int64)
    starts = np.concatenate([[0], ends[:-1]])
    assert (mask[ends - 1] == 0).all()
    return [(ids[a:b - 1].tolist(), mask[a:b - 1].tolist()) for a, b in zip(starts, ends)]


def _prepared(tmp_path, name, records, turns="all"):
    tok = template_tokenizer(name)
    path = _jsonl(tmp_path / f"{name}.jsonl", records)
    store, _ = prepare(DataSpec(path, format="chat", chat_turns=turns), tok, 64, str(tmp_path / "stores"))
    return tok, _store_docs(store)


def _check_against_template(tok, docs, records, turns="all") -> None:
    """Every trained turn: some document starts with the template's tokens of messages[:i+1] and carries loss on
    exactly the tokens past messages[:i] + generation prompt; no other token carries loss."""
    expected = [t for r in records for t in expected_turns(tok, r, turns)]
    for prompt, full in expected:
        assert full[:len(prompt)] == prompt  # the turn continues its generation prompt
        home = [mask for ids, mask in docs if ids[:len(full)] == full]
        assert home and all(m[len(prompt):len(full)] == [1] * (len(full) - len(prompt)) for m in home)
    assert sum(sum(m) for _, m in docs) == sum(len(full) - len(prompt) for prompt, full in expected)


def _trained_text(tok, docs) -> list[str]:
    """The text of each run of loss tokens, in order."""
    out = []
    for ids, mask in docs:
        run = []
        for token, loss in zip(ids + [None], mask + [0]):
            if loss:
                run.append(token)
            elif run:
                out.append(tok.decode(run))
                run = []
    return out


@pytest.mark.parametrize("name", ["llama3_1", "qwen2_5"])
def test_tool_calls_train_as_the_template_renders_them(tmp_path, name):
    records = tool_records(reasoning=False)
    tok, docs = _prepared(tmp_path, name, records)
    _check_against_template(tok, docs, records)
    assert len(docs) == len(records)  # prefix-stable: each conversation is one document, as rendered whole
    for (ids, _), record in zip(docs, records):
        assert ids == tok.apply_chat_template(record["messages"], tools=record.get("tools"), tokenize=True,
                                              return_dict=True)["input_ids"]
    trained = _trained_text(tok, docs)
    if name == "llama3_1":
        assert trained[:2] == ['{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
                               "It is 18 C in Paris.<|eot_id|>"]
        # datasets padded the search call's arguments with city=None (and get_weather's with query, limit): gone
        assert trained[4] == '{"name": "search", "parameters": {"query": "dsharness", "limit": 3}}<|eot_id|>'
    else:
        assert trained[:2] == ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
                               '<|im_end|>\n', "It is 18 C in Paris.<|im_end|>\n"]
        assert trained[4] == ('<tool_call>\n{"name": "search", "arguments": {"query": "dsharness", "limit": 3}}\n'
                              '</tool_call><|im_end|>\n')
    assert len(trained) == 8


def test_qwen3_trains_each_turn_with_the_history_it_sees_at_inference(tmp_path):
    """Qwen3 drops the <think> block of turns before the last user message: rendered whole, the conversation has
    no Paris reasoning at all. Each turn trains in messages[:i+1] as the template renders it; the turns between
    two user messages share a document (their rendering continues each other)."""
    records = tool_records(reasoning=True)
    tok, docs = _prepared(tmp_path, "qwen3", records)
    _check_against_template(tok, docs, records)
    whole = tok.apply_chat_template(records[0]["messages"], tools=[WEATHER], tokenize=False)
    assert "The tool said 18." not in whole and "Rome is 21." in whole
    # weather: turns 2 and 4 (before the second user message) in messages[:5], turns 6 and 8 in the whole;
    # search: its tool call (no reasoning) has an empty <think> block when last, none once the result follows, so
    # it trains in messages[:2], the answer in the whole; plain: its first turn alone, then the whole
    assert len(docs) == 2 + 2 + 2
    texts = [tok.decode(ids) for ids, _ in docs]
    assert "The tool said 18." in texts[0] and "And Rome?" not in texts[0] and texts[1] == whole
    trained = _trained_text(tok, docs)
    assert trained[:2] == ['<think>\nCall it.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
                           '{"city": "Paris"}}\n</tool_call><|im_end|>\n',
                           "<think>\nThe tool said 18.\n</think>\n\nIt is 18 C in Paris.<|im_end|>\n"]
    assert trained[5] == "<think>\nThree found.\n</think>\n\nFound 3.<|im_end|>\n"  # from <think> in the content
    assert trained[6] == "<think>\na-z\n</think>\n\ncat dog<|im_end|>\n"
    assert trained[7] == "<think>\n\n</think>\n\nbird fish<|im_end|>\n"  # the template's empty block, as at inference
    # the last turn only: one document per record, messages[:last+1]
    tok, last = _prepared(tmp_path, "qwen3", records, turns="last")
    _check_against_template(tok, last, records, turns="last")
    assert len(last) == len(records) and len(_trained_text(tok, last)) == len(records)


def test_gemma3_and_a_system_prompt(tmp_path):
    records = plain_records()
    tok, docs = _prepared(tmp_path, "gemma3", records)
    _check_against_template(tok, docs, records)
    assert len(docs) == 2 and _trained_text(tok, docs) == ["a b<end_of_turn>\n", "c d<end_of_turn>\n",
                                                           "Hello.<end_of_turn>\n"]
    assert tok.decode(docs[0][0]).startswith("<bos><start_of_turn>user\nBe brief.\n\nSort: b a<end_of_turn>\n")


def test_generation_markers_decide_the_loss(tmp_path):
    """A template with {% generation %} markers (TRL's Qwen3 training template): the loss mask is HF's
    return_assistant_tokens_mask over the same rendering."""
    records = tool_records(reasoning=True)
    tok, docs = _prepared(tmp_path, "qwen3_training", records)
    assert len(docs) == len(records)  # this template keeps every <think> block: prefix-stable
    for (ids, mask), record in zip(docs, records):
        out = tok.apply_chat_template(record["messages"], tools=record.get("tools"), tokenize=True,
                                      return_dict=True, return_assistant_tokens_mask=True)
        assert ids == out["input_ids"] and mask == out["assistant_masks"]
    _check_against_template(tok, docs, records)


REFUSED = [
    ("gemma3", {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "checking"},
                             {"role": "tool", "content": "3 C"}, {"role": "assistant", "content": "3 C."}]},
     "cannot be rendered by the tokenizer's chat template (TemplateError: Conversation roles must alternate "
     "user/assistant/user/assistant/...)"),
    ("gemma3", {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "",
                                                                 "tool_calls": [call("get_weather", city="Oslo")]}]},
     "message 1 (assistant) renders without its tool call 'get_weather' (the template does not read tool_calls)"),
    ("gemma3", {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
                "tools": [WEATHER]}, "its tool 'get_weather' does not appear in the rendering"),
    ("llama3_1", {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y",
                                                                    "reasoning_content": "think first"}]},
     "message 1 (assistant) renders without its reasoning_content"),
    ("llama3_1", {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [
        call("get_weather", city="A"), call("get_weather", city="B")]}], "tools": [WEATHER]},
     "(TemplateError: This model only supports single tool-calls at once!)"),
    ("qwen2_5", {"messages": "hello"}, "holds str ('hello'), not a list of messages"),
]


@pytest.mark.parametrize("name, bad, message", REFUSED)
def test_a_record_the_template_cannot_train_is_refused_with_file_and_line(tmp_path, name, bad, message):
    good = plain_records()
    path = _jsonl(tmp_path / "d.jsonl", good + [bad] + good)
    with pytest.raises(UsageError) as err:
        check_chat_head(DataSpec(path, format="chat"), template_tokenizer(name))
    assert str(err.value).startswith(f"data file {path} line 3 is not a chat record the tokenizer's template can "
                                     "train (train.format 'chat'): ")
    assert message in str(err.value) and "\n    fix: " in str(err.value)


def test_a_record_past_the_checked_head_is_named_by_number(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "HEAD_RECORDS", 2)
    name, bad, message = REFUSED[0]
    path = _jsonl(tmp_path / "d.jsonl", plain_records() + [bad])
    assert check_chat_head(DataSpec(path, format="chat"), template_tokenizer(name)) == (2, 0)
    with pytest.raises(UsageError) as err:
        prepare(DataSpec(path, format="chat"), template_tokenizer(name), 16, str(tmp_path / "stores"))
    assert "record 3 (counting from 1 over the dataset's files) (train.format 'chat') " + message in str(err.value)


def test_the_head_check_counts_records_the_template_renders_in_pieces(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", tool_records(reasoning=True))
    assert check_chat_head(DataSpec(path, format="chat"), template_tokenizer("qwen3")) == (3, 3)
    assert check_chat_head(DataSpec(path, format="chat", chat_turns="last"), template_tokenizer("qwen3")) == (3, 0)
    assert check_chat_head(DataSpec(path, format="chat"), template_tokenizer("qwen3_training")) == (3, 0)


def test_records_without_assistant_turns_or_messages():
    tok = template_tokenizer("qwen2_5")
    docs, whole = documents(tok, [{"role": "user", "content": "hi"}])
    assert whole and docs == [[(tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False), 0)]]
    assert documents(tok, []) == ([], True)
    greeting = [{"role": "assistant", "content": "Hi there"}, {"role": "user", "content": "x"},
                {"role": "assistant", "content": "y"}]  # no template renders the empty conversation before it
    [doc], _ = documents(tok, greeting)
    assert [text for text, loss in doc if loss] == ["y<|im_end|>\n"] and "Hi there" in doc[0][0]


def test_the_launch_says_when_the_template_rewrites_history(tmp_path):
    """Before any rank trains (train/checks.py): a note naming how many of the head's records train in more than
    one sample; none under chat_turns=last or a prefix-stable template; a template error is a train.dataset
    problem."""
    from harness.train.checks import chat_problems

    model = tmp_path / "model"
    template_tokenizer("qwen3").save_pretrained(model)
    path = _jsonl(tmp_path / "d.jsonl", tool_records(reasoning=True))
    train = {"model": str(model), "dataset": path, "format": "chat", "objective": "lm"}
    [note] = chat_problems(train)
    assert note.severity == "warning" and note.path == "train.dataset"
    assert "renders 3 of the first 3 records differently once later messages follow" in note.message
    assert chat_problems({**train, "chat_turns": "last"}) == []
    template_tokenizer("llama3_1").save_pretrained(model)
    assert chat_problems({**train, "dataset": _jsonl(tmp_path / "t.jsonl", tool_records(reasoning=False))}) == []
    bad = _jsonl(tmp_path / "bad.jsonl", [{"messages": [{"role": "user", "content": "x"}, {
        "role": "assistant", "content": "y", "thinking": "hidden"}]}])  # transformers' alias of reasoning_content
    [problem] = chat_problems({**train, "dataset": bad})
    assert problem.severity == "error" and "renders without its reasoning_content" in problem.message


def test_data_prepare_checks_the_head_and_says_what_it_split(tmp_path, capsys):
    from harness.cli import main

    model = tmp_path / "model"
    template_tokenizer("qwen3").save_pretrained(model)
    path = _jsonl(tmp_path / "d.jsonl", tool_records(reasoning=True))
    argv = ["data", "prepare", "--model", str(model), "--seq-len", "64", "--format", "chat", "--out", str(tmp_path)]
    assert main(argv + ["--dataset", path]) == 0
    assert "[data] the chat template rewrites history in 3 of the first 3 records" in capsys.readouterr().out
    name, bad, message = REFUSED[3]  # reasoning_content under Llama 3.1's template
    template_tokenizer(name).save_pretrained(model)
    bad_path = _jsonl(tmp_path / "bad.jsonl", [bad])
    assert main(argv + ["--dataset", bad_path]) == 2
    assert f"data file {bad_path} line 1 is not a chat record" in capsys.readouterr().err


def test_markers_on_a_template_that_rewrites_history(tmp_path):
    """Qwen3's own template with {% generation %} around its whole assistant branch (role header included): the
    turns still train in their inference contexts, and the marked header, which the generation prompt writes, carries
    no loss, so the documents equal the unmarked template's."""
    from helpers.chat_templates import TEMPLATES

    lines = (TEMPLATES / "qwen3.jinja").read_text().split("\n")
    start = lines.index('    {%- elif message.role == "assistant" %}')
    end = lines.index('    {%- elif message.role == "tool" %}')
    marked = "\n".join(lines[:start + 1] + ["{%- generation %}"] + lines[start + 1:end] + ["{%- endgeneration %}"]
                       + lines[end:])
    plain, tok = template_tokenizer("qwen3"), template_tokenizer("qwen3")
    tok.chat_template = marked
    for record in tool_records(reasoning=True):
        got = documents(tok, record["messages"], record.get("tools"))
        assert got == documents(plain, record["messages"], record.get("tools")) and not got[1]
        trained = "".join(text for doc in got[0] for text, loss in doc if loss)
        hf = tok.apply_chat_template(record["messages"], tools=record.get("tools"), tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True)
        hf_trained = tok.decode([i for i, m in zip(hf["input_ids"], hf["assistant_masks"]) if m])
        assert "<|im_start|>assistant" in hf_trained and "<|im_start|>" not in trained


def test_the_head_check_renders_a_bounded_number_of_records(tmp_path, monkeypatch):
    """A folder of many shards: each gets its share of the render budget (at least its first record), so the check
    before launch does not grow with the number of files; a bad first record of the last shard is still named."""
    from harness.data import chat_check

    monkeypatch.setattr(chat_check, "RENDER_BUDGET", 6)
    folder = tmp_path / "shards"
    folder.mkdir()
    for n in range(4):
        _jsonl(folder / f"part{n}.jsonl", plain_records() * 3)
    spec, tok = DataSpec(str(folder), format="chat"), template_tokenizer("qwen2_5")
    assert check_chat_head(spec, tok) == (4, 0)  # 6 // 4 = 1 record of each of 4 files
    _jsonl(folder / "part3.jsonl", [REFUSED[-1][1]] + plain_records())
    with pytest.raises(UsageError, match=r"part3.jsonl line 1 is not a chat record"):
        check_chat_head(spec, tok)


def test_sharegpt_records_train_as_chat_under_a_template_that_rewrites_history(tmp_path):
    turns = [{"from": "human", "value": "Sort: b a"}, {"from": "gpt", "value": "<think>\nab\n</think>\n\na b"},
             {"from": "human", "value": "Sort: d c"}, {"from": "gpt", "value": "c d"}]
    tok = template_tokenizer("qwen3")
    share = _jsonl(tmp_path / "s.jsonl", [{"conversations": turns}] * 3)
    chat = _jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": {"human": "user", "gpt": "assistant"}[t["from"]],
                                                         "content": t["value"]} for t in turns]}] * 3)
    a, _ = prepare(DataSpec(share, format="sharegpt"), tok, 16, str(tmp_path / "stores"))
    b, _ = prepare(DataSpec(chat, format="chat"), tok, 16, str(tmp_path / "stores"))
    assert _store_docs(a) == _store_docs(b) and len(_store_docs(a)) == 6  # the first turn's <think> kept in its own
    assert "<think>\nab\n</think>" in _trained_text(tok, _store_docs(a))[0]


def test_a_parquet_file_of_padded_structs_trains_as_its_json_lines(tmp_path):
    """pyarrow (and so a parquet file, or datasets before 5) stores the records as structs whose fields are the union
    over the file: every message gets tool_calls=None, the Paris call gets query=None and limit=None. The nulls are
    dropped before rendering, so the store equals the one made from the same records as JSON lines."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = tool_records(reasoning=False)
    table = pa.Table.from_pylist(records)
    assert table.to_pylist()[0]["messages"][0]["tool_calls"] is None  # the padding is real
    pq.write_table(table, tmp_path / "d.parquet")
    tok = template_tokenizer("llama3_1")
    a, _ = prepare(DataSpec(str(tmp_path / "d.parquet"), format="chat"), tok, 64, str(tmp_path / "stores"))
    b, _ = prepare(DataSpec(_jsonl(tmp_path / "d.jsonl", records), format="chat"), tok, 64, str(tmp_path / "stores"))
    assert a.path != b.path and _store_docs(a) == _store_docs(b)
    assert '"limit": null' not in tok.decode(_store_docs(a)[0][0])
