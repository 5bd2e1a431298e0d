"""ShareGPT and Alpaca records train as chat and instruction, each record its own document, without a conversion
script: the store equals the one made from the same records converted by hand, and bad records are refused
naming the file and line (or record) and the fix."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from helpers.corpora import WORDS, chat_tokenizer  # noqa: E402
from harness.data import files  # noqa: E402
from harness.data.corpus import DataSpec  # noqa: E402
from harness.data.rows import IGNORE_INDEX, Rows  # noqa: E402
from harness.data.store import prepare  # noqa: E402
from harness.errors import UsageError  # noqa: E402
from harness.model.hf import load_tokenizer  # noqa: E402

ROLE = {"human": "user", "gpt": "assistant", "system": "system"}


def _jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _sharegpt(num: int) -> list[dict]:
    out = []
    for i in range(num):
        turns = [{"from": "system", "value": "Be brief."}] if i % 2 else []
        for j in range(1 + i % 3):
            q = " ".join(WORDS[(i + j + k) % len(WORDS)] for k in range(3 + j))
            turns += [{"from": "human", "value": q}, {"from": "gpt", "value": " ".join(sorted(q.split()))}]
        out.append({"id": i, "conversations": turns})
    return out


def _alpaca(num: int) -> list[dict]:
    return [{"instruction": f"Sort: {' '.join(WORDS[i:i + 4])}", "input": ("" if i % 2 else f"case {i}"),
             "output": " ".join(sorted(WORDS[i:i + 4]))} for i in range(num)]


def _files(store) -> tuple[bytes, bytes, bytes]:
    return tuple((store.path / name).read_bytes() for name in ("tokens.bin", "loss_mask.bin", "doc_index.bin"))


def test_sharegpt_is_chat_with_a_document_per_conversation(tmp_path):
    records = _sharegpt(12)
    path = _jsonl(tmp_path / "sharegpt.jsonl", records)
    store, _ = prepare(DataSpec(path, format="sharegpt"), chat_tokenizer(), 32, str(tmp_path / "stores"))
    converted = _jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": ROLE[t["from"]], "content": t["value"]}
                                                               for t in r["conversations"]]} for r in records])
    chat, _ = prepare(DataSpec(converted, format="chat"), chat_tokenizer(), 32, str(tmp_path / "stores"))
    assert store.path != chat.path and _files(store) == _files(chat)
    assert store.meta["documents"] == len(records)
    tok = chat_tokenizer()
    ids = np.fromfile(store.path / "tokens.bin", store.meta["dtype"])
    mask = np.fromfile(store.path / "loss_mask.bin", np.uint8).astype(bool)
    assert tok.decode(ids[mask].tolist()) == "".join(t["value"] + "\n" for r in records
                                                     for t in r["conversations"] if t["from"] == "gpt")
    ends = np.fromfile(store.path / "doc_index.bin", np.uint64).astype(np.int64)
    assert (ids[ends - 1] == tok.eos_token_id).all()  # every conversation ends its own document
    # document packing: each conversation that starts inside a row has its first label -100 and position 0
    _, labels, positions = Rows.of(store, "document").tensors()
    starts = [e for e in ends[:-1] if e < labels.numel() and e % 32]
    assert starts and (labels.flatten()[starts] == IGNORE_INDEX).all() and (positions.flatten()[starts] == 0).all()


def test_alpaca_is_instruction_in_the_alpaca_template(tmp_path):
    from harness.data.formats import ALPACA_PROMPT, ALPACA_PROMPT_NO_INPUT

    records = _alpaca(10)
    path = _jsonl(tmp_path / "alpaca.jsonl", records)
    tok = load_tokenizer("tiny-llama")
    store, _ = prepare(DataSpec(path, format="alpaca"), tok, 32, str(tmp_path / "stores"))
    prompts = [ALPACA_PROMPT.format(**r) if r["input"] else ALPACA_PROMPT_NO_INPUT.format(**r) for r in records]
    assert "### Input:\ncase 0\n\n### Response:\n" in prompts[0] and "### Input" not in prompts[1]
    converted = _jsonl(tmp_path / "inst.jsonl", [{"prompt": p, "response": r["output"]}
                                                 for p, r in zip(prompts, records)])
    inst, _ = prepare(DataSpec(converted, format="instruction"), tok, 32, str(tmp_path / "stores"))
    assert _files(store) == _files(inst) and store.meta["documents"] == len(records)
    ids = np.fromfile(store.path / "tokens.bin", store.meta["dtype"])
    mask = np.fromfile(store.path / "loss_mask.bin", np.uint8).astype(bool)
    assert tok.decode(ids[mask].tolist()) == "".join(r["output"] + "<|endoftext|>" for r in records)
    # the input column is optional
    no_input = _jsonl(tmp_path / "noinput.jsonl", [{k: r[k] for k in ("instruction", "output")} for r in records])
    store2, _ = prepare(DataSpec(no_input, format="alpaca"), tok, 32, str(tmp_path / "stores"))
    assert tok.decode(np.fromfile(store2.path / "tokens.bin", store2.meta["dtype"]).tolist()).count(
        "### Input") == 0 and store2.meta["documents"] == len(records)


BAD = [
    ("sharegpt", {"conversations": [{"from": "human", "value": "hi"}, {"from": "bot", "value": "yo"}]},
     r"line 3 is not a valid sharegpt record: 'conversations' turn 1 has from='bot', not one of human, gpt, system"),
    ("sharegpt", {"conversations": [{"from": "human", "value": None}]},
     r"line 3 is not a valid sharegpt record: 'conversations' turn 0 \(human\) has value=None, not text"),
    ("sharegpt", {"conversations": [{"from": "human", "value": "a"}, {"from": "system", "value": "b"}]},
     r"turn 1 is a system turn after the first"),
    ("sharegpt", {"conversations": []}, r"'conversations' holds list \('\[\]'\), not a non-empty list of turns"),
    ("alpaca", {"instruction": "", "output": "x"}, r"line 3 is not a valid alpaca record: has instruction='', not non-empty"),
    ("alpaca", {"instruction": "do", "output": 3}, r"has output=3, not text"),
    ("alpaca", {"instruction": "do", "input": ["x"], "output": "y"}, r"has input=\['x'\], not text"),
]


@pytest.mark.parametrize("fmt, bad, message", BAD)
def test_bad_records_are_refused_with_file_line_and_fix(tmp_path, fmt, bad, message):
    good = _sharegpt(2) if fmt == "sharegpt" else _alpaca(2)
    path = _jsonl(tmp_path / "d.jsonl", good + [bad] + good)
    with pytest.raises(UsageError, match=message) as err:
        prepare(DataSpec(path, format=fmt), chat_tokenizer(), 16, str(tmp_path / "stores"))
    assert str(err.value).startswith(f"data file {path} line 3") and "\n    fix: " in str(err.value)


def test_a_bad_record_past_the_checked_head_is_named_when_tokenizing(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "HEAD_RECORDS", 2)  # the head check reads 2 records; record 4 is bad
    records = _alpaca(3) + [{"instruction": "do", "output": None}] + _alpaca(2)
    path = _jsonl(tmp_path / "a.jsonl", records)
    with pytest.raises(UsageError, match=r"record 4 \(counting from 1 over the dataset's files\) \(train.format "
                                         r"'alpaca'\) has output=None, not text: .*\n    fix: each record needs"):
        prepare(DataSpec(path, format="alpaca"), load_tokenizer("tiny-llama"), 16, str(tmp_path / "stores"))


def test_cli_refuses_bad_records_with_exit_2(tmp_path, capsys):
    from harness.cli import main

    path = _jsonl(tmp_path / "a.jsonl", [{"instruction": "do", "output": ["y"]}])
    assert main(["data", "prepare", "--dataset", path, "--model", "tiny-llama", "--seq-len", "16",
                 "--format", "alpaca", "--out", str(tmp_path)]) == 2
    assert "line 1 is not a valid alpaca record: has output=['y'], not text" in capsys.readouterr().err
    path = _jsonl(tmp_path / "s.jsonl", [{"conversations": [{"from": "user", "value": "hi"}]}])
    assert main(["data", "prepare", "--dataset", path, "--model", "tiny-llama", "--seq-len", "16",
                 "--format", "sharegpt", "--out", str(tmp_path)]) == 2
    assert "train.format is 'sharegpt' but the tokenizer of model tiny-llama has no chat template" in \
        capsys.readouterr().err
