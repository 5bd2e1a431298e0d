"""Preference data (issue 32 part 2): records -> pairs by TRL's rules, masks, truncation, the Pairs view, the
store's cache, and bad input refused with exit 2 before any rank trains.

The expected ids are computed here from the tokenizer by TRL's recipe (trl/trainer/dpo_trainer.py
_prepare_dataset, 2026), written out: prompt ids = tok(prompt), completion = tok(prompt + completion + eos text)
past the prompt's ids; message lists through the chat template, the prompt with the generation prompt.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch

from helpers.corpora import chat_tokenizer
from harness.data.corpus import DataSpec
from harness.data.preference import Pairs, load_pairs, notes
from harness.data.preference_store import prepare_pairs
from harness.data.rows import IGNORE_INDEX, split_rows
from harness.errors import UsageError
from harness.model.hf import load_tokenizer

Q = "Question: what color is the sky?\nAnswer:"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny-llama")


@pytest.fixture(scope="module")
def chat_tok():
    return chat_tokenizer()


def jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def pairs_of(path, tok, seq_len, truncation="truncate", root=None, **fields):
    store, made = prepare_pairs(DataSpec(str(path), objective="dpo", **fields), tok, seq_len, truncation,
                                str(root or path.parent / "stores"))
    return Pairs.of(store), store["meta"], made


def rows_of(pairs, i):
    """(chosen ids, chosen labels, rejected ids, rejected labels) of pair i, padding cut."""
    ids, labels = pairs[[i]].tensors()
    return ids[0], labels[0], ids[1], labels[1]


def trl_text(tok, prompt, completion):
    p = tok(prompt)["input_ids"]
    full = tok(prompt + completion + tok.eos_token)["input_ids"]
    return p, full[len(p):]


def trl_chat(tok, prompt, completion):
    p = tok.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
    full = tok.apply_chat_template(prompt + completion, tokenize=True, return_dict=True)["input_ids"]
    return list(p), list(full[len(p):])


def assert_row(ids, labels, prompt, completion, seq_len, pad):
    n = len(prompt) + len(completion)
    assert ids[:n].tolist() == prompt + completion and (ids[n:] == pad).all()
    assert (labels[:len(prompt)] == IGNORE_INDEX).all() and (labels[n:] == IGNORE_INDEX).all()
    assert labels[len(prompt):n].tolist() == completion and ids.shape == (seq_len,)


def test_text_pairs_follow_trl_joining_with_eos_and_exact_masks(tmp_path, tok):
    records = [{"prompt": Q, "chosen": " It is blue.", "rejected": " It is green, like grass."},
               {"prompt": "2 + 2 =", "chosen": " 4" + tok.eos_token, "rejected": " 5"}]  # eos already there: once
    pairs, meta, _ = pairs_of(jsonl(tmp_path / "p.jsonl", records), tok, 64)
    assert pairs.shape == (2, 64) and meta["truncated"] == meta["mismatched"] == 0
    for i, r in enumerate(records):
        chosen_ids, chosen_labels, rejected_ids, rejected_labels = rows_of(pairs, i)
        prompt, chosen = trl_text(tok, r["prompt"], r["chosen"].removesuffix(tok.eos_token))
        _, rejected = trl_text(tok, r["prompt"], r["rejected"])
        assert chosen[-1] == rejected[-1] == tok.eos_token_id and chosen.count(tok.eos_token_id) == 1
        assert_row(chosen_ids, chosen_labels, prompt, chosen, 64, tok.pad_token_id)
        assert_row(rejected_ids, rejected_labels, prompt, rejected, 64, tok.pad_token_id)
    _, labels = pairs.tensors()
    scored = (labels[:, 1:] != IGNORE_INDEX).sum(1)
    assert torch.equal(pairs.completion_tokens(), scored)


def test_message_and_ultrafeedback_pairs_use_the_chat_template(tmp_path, chat_tok):
    user = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "sky color?"}]
    good, bad = [{"role": "assistant", "content": "blue"}], [{"role": "assistant", "content": "green"}]
    records = [{"prompt": user, "chosen": good, "rejected": bad},
               {"prompt": "sky color?", "chosen": user + good, "rejected": user + bad},  # UltraFeedback: str prompt
               {"chosen": user + good, "rejected": user + bad}]  # no prompt: the common prefix
    pairs, meta, _ = pairs_of(jsonl(tmp_path / "m.jsonl", records), chat_tok, 48)
    prompt, chosen = trl_chat(chat_tok, user, good)
    _, rejected = trl_chat(chat_tok, user, bad)
    assert chat_tok.decode(chosen) == "blue\n" and chat_tok.decode(prompt).endswith("<|assistant|>")
    for i in range(3):
        chosen_ids, chosen_labels, rejected_ids, rejected_labels = rows_of(pairs, i)
        assert_row(chosen_ids, chosen_labels, prompt, chosen, 48, chat_tok.pad_token_id)
        assert_row(rejected_ids, rejected_labels, prompt, rejected, 48, chat_tok.pad_token_id)
    assert meta["mismatched"] == 0


def test_parquet_and_json_array_files_give_the_same_pairs_as_json_lines(tmp_path, chat_tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    user = [{"role": "user", "content": f"word {i}?"} for i in range(3)]
    records = [{"prompt": "p", "chosen": [u, {"role": "assistant", "content": "yes"}],
                "rejected": [u, {"role": "assistant", "content": "no"}]} for u in user]
    want, _, _ = pairs_of(jsonl(tmp_path / "a.jsonl", records), chat_tok, 32)
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "a.parquet")
    (tmp_path / "a.json").write_text(json.dumps(records))
    for name in ("a.parquet", "a.json"):
        got, meta, _ = pairs_of(tmp_path / name, chat_tok, 32)
        assert meta["pairs"] == 3 and all(torch.equal(a, b) for a, b in zip(got.tensors(), want.tensors()))


def test_text_without_a_prompt_splits_at_the_common_prefix_like_trl(tmp_path, tok):
    records = [{"chosen": Q + " Blue sky.", "rejected": Q + " Green sky."},  # the space goes with the completion
               {"chosen": Q + " It is blue.", "rejected": Q + " It is green."}]  # the prompt runs to " It is"
    pairs, _, _ = pairs_of(jsonl(tmp_path / "hh.jsonl", records), tok, 64)
    for i, (prompt_text, completion) in enumerate([(Q, " Blue sky."), (Q + " It is", " blue.")]):
        chosen_ids, chosen_labels, _, _ = rows_of(pairs, i)
        prompt, chosen = trl_text(tok, prompt_text, completion)
        assert_row(chosen_ids, chosen_labels, prompt, chosen, 64, tok.pad_token_id)


def test_truncate_cuts_the_completion_end_and_drop_counts(tmp_path, tok):
    long = " blue" * 40
    records = [{"prompt": Q, "chosen": " blue.", "rejected": " green."},
               {"prompt": Q, "chosen": long, "rejected": " green."},
               {"prompt": Q * 6, "chosen": " a", "rejected": " b"}]  # the prompt alone is past seq_len
    path = jsonl(tmp_path / "t.jsonl", records[:2])
    prompt, full = trl_text(tok, Q, long)
    seq_len = len(prompt) + 12
    pairs, meta, _ = pairs_of(path, tok, seq_len, "truncate")
    assert meta["pairs"] == 2 and meta["truncated"] == 1 and pairs.shape == (2, seq_len)
    chosen_ids, chosen_labels, _, _ = rows_of(pairs, 1)
    assert chosen_ids.tolist() == prompt + full[:12] and (chosen_labels[len(prompt):] != IGNORE_INDEX).all()
    dropped, meta, _ = pairs_of(jsonl(tmp_path / "d.jsonl", records), tok, seq_len, "drop")
    assert (meta["pairs"], meta["dropped_long"], meta["dropped_prompt"], meta["truncated"]) == (1, 1, 1, 0)
    assert dropped.records.tolist() == [0]
    assert "2 dropped (1 longer than seq_len, 1 whose prompt fills it)" in notes(meta, "drop")[0]


def test_tensors_put_chosen_first_ids_are_stable_and_the_store_is_reused(tmp_path, tok):
    records = [{"prompt": f"Q{i}:", "chosen": f" yes {i}", "rejected": f" no {i}"} for i in range(10)]
    path = jsonl(tmp_path / "s.jsonl", records)
    pairs, _, made = pairs_of(path, tok, 24)
    again, _, made_again = pairs_of(path, tok, 24)
    assert made and not made_again and again.path == pairs.path
    train, held = split_rows(pairs, 0.2, seed=3)
    assert len(train) == 8 and sorted(train.ids.tolist() + held.ids.tolist()) == list(range(10))
    batch = train[torch.tensor([4, 1, 6])]
    ids, labels = batch.tensors()
    assert ids.shape == labels.shape == (6, 24) and ids.dtype == labels.dtype == torch.long
    for row, pair in enumerate(batch.ids.tolist()):  # row b is pair b's chosen, row B + b its rejected
        text = tok.decode(labels[row][labels[row] != IGNORE_INDEX])
        other = tok.decode(labels[row + 3][labels[row + 3] != IGNORE_INDEX])
        assert (text, other) == (f" yes {pair}{tok.eos_token}", f" no {pair}{tok.eos_token}")
    assert torch.equal(split_rows(again, 0.2, seed=3)[0][torch.tensor([4, 1, 6])].ids, batch.ids)
    assert np.shares_memory(batch.store["chosen"], pairs.store["chosen"])  # a view of the one map


def test_data_prepare_builds_the_store_a_run_reuses_and_counts_identical_pairs(tmp_path, tok, capsys):
    from harness.cli import main

    records = [{"prompt": f"Q{i}:", "chosen": f" yes {i}", "rejected": f" no {i}"} for i in range(5)]
    path = jsonl(tmp_path / "c.jsonl", records + [{"prompt": "Q:", "chosen": " same", "rejected": " same"}])
    root = tmp_path / "stores"
    assert main(["data", "prepare", "--dataset", str(path), "--model", "tiny-llama", "--seq-len", "24", "--out",
                 str(root), "--set", "train.objective=dpo", "--set", "preference.truncation=drop"]) == 0
    out = capsys.readouterr().out
    assert "prepared in" in out and "6 pairs from 6 records" in out and "1 pairs have the same chosen" in out
    _, meta, made = pairs_of(path, tok, 24, "drop", root=root)
    assert not made and meta["identical"] == 1


def test_builtin_preference_set_and_load_pairs(tmp_path, tok):
    from types import SimpleNamespace

    recipe = {"train": {"dataset": "builtin", "objective": "dpo", "seq_len": 64, "store_dir": str(tmp_path),
                        "eval_fraction": 0.05, "seed": 0, "model": "tiny-llama"},
              "preference": {"truncation": "truncate"}}
    built, _ = prepare_pairs(DataSpec(objective="dpo"), tok, 64, "truncate", str(tmp_path))  # in this process
    # (a launch's local rank 0 builds it in a spawned child: store.run_in_child, tested in test_store.py)
    train, held, lines = load_pairs(SimpleNamespace(recipe=recipe), SimpleNamespace(local_rank=0), tok)
    assert (len(train), len(held)) == (190, 10) and train.shape[1] == 64 and train.path == built["path"]
    assert lines[0].startswith(f"using preference store {built['path']}")
    assert "200 pairs from 200 records" in lines[1] and "0 truncated" in lines[1]
    ids, labels = train[:4].tensors()
    assert all(tok.decode(ids[i]).startswith("Question: ") for i in range(8))
    assert not torch.equal(labels[:4], labels[4:])


OK = {"prompt": "ok", "chosen": " y", "rejected": " n"}
BAD = [  # (the file's records, seq_len, where, what the message says)
    ([OK, {"prompt": "a", "chosen": " b"}], 32, "line 2", "has no 'rejected'"),
    ([OK, {"prompt": "a", "chosen": " b", "rejected": " "}], 32, "line 2", "has an empty 'rejected' completion"),
    ([OK, {"prompt": "a", "chosen": " b", "rejected": [{"role": "assistant", "content": "c"}]}], 32, "line 2",
     "'chosen' is a str and 'rejected' a message list"),
    ([{"chosen": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
       "rejected": [{"role": "user", "content": "z"}, {"role": "assistant", "content": "y"}]}], 32, "line 1",
     "share no first message to take as the prompt"),
    ([OK, OK, {"prompt": Q * 4, "chosen": " b", "rejected": " c"}], 32, "line 3",
     "no room for a single completion token"),
    ([{"prompt": "a", "chosen": " b", "rejected": " b"}] * 3, 32, "", "chosen and rejected are the same tokens"),
    ([{"prompt": [{"role": "user", "content": "a"}], "chosen": [{"role": "assistant", "content": "b"}],
       "rejected": [{"role": "assistant", "content": "c"}]}], 32, "line 1", "holds message lists but the tokenizer"),
]


def test_bad_records_exit_2_naming_file_line_and_fix_before_any_rank(tmp_path, capsys, monkeypatch):
    from harness import run

    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    failures = []
    for n, (records, seq_len, where, finding) in enumerate(BAD):
        path = jsonl(tmp_path / f"bad{n}.jsonl", records)
        code = run.main(["--recipe", "zero2", "--dataset", str(path), "--output-dir", str(tmp_path / "run"),
                         "--set", "train.objective=dpo", "--set", f"train.seq_len={seq_len}"])
        err = capsys.readouterr().err
        if code != 2 or finding not in err or f"{path} {where}".strip() not in err or "    fix: " not in err \
                or "Traceback" in err:
            failures.append(f"{path.name}: exit {code}, want 2 with {finding!r} at {where!r}\n{err}")
    assert not failures, "\n".join(failures)
    assert not (tmp_path / "run").exists(), "a bad preference file got as far as the run folder"
    assert "torch.distributed" not in sys.modules or not sys.modules["torch.distributed"].is_initialized()


def test_a_bad_record_past_the_head_is_refused_by_the_store_build_and_drop_keeps_going(tmp_path, tok):
    from harness.data.files import HEAD_RECORDS

    good = [{"prompt": "q", "chosen": " y", "rejected": " n"}] * HEAD_RECORDS
    path = jsonl(tmp_path / "late.jsonl", good + [{"prompt": Q * 4, "chosen": " a", "rejected": " b"}])
    with pytest.raises(UsageError, match=f"record {HEAD_RECORDS + 1} .*no room for a single completion token"):
        pairs_of(path, tok, 16)
    _, meta, _ = pairs_of(path, tok, 16, "drop")
    assert (meta["pairs"], meta["dropped_prompt"]) == (HEAD_RECORDS, 1)
