"""The prepared token store: contents, reuse by key, atomic publication, stale and partial stores rebuilt."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from helpers.corpora import chat_tokenizer, write_chat  # noqa: E402
from harness.errors import UsageError  # noqa: E402
from harness.data import store as storemod  # noqa: E402
from harness.data.corpus import DataSpec  # noqa: E402
from harness.model.hf import load_tokenizer  # noqa: E402
from harness.data.store import dtype_for, open_store, prepare, store_key, store_path  # noqa: E402

DOCS = ["The cat eats fish.", "", "A dog barks at the gate.", "Monday, Tuesday, Wednesday."]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny-llama")


def corpus(folder, docs=DOCS, copies=1):
    path = folder / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs * copies))
    return path


def test_store_holds_documents_joined_with_eos_and_rows_are_a_reshape(tmp_path, tok):
    spec = DataSpec(str(corpus(tmp_path)))
    store, made = prepare(spec, tok, 4, str(tmp_path / "stores"))
    expected, ends = [], []
    for doc in DOCS:
        if doc:  # an empty document adds nothing
            expected += tok(doc, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            ends.append(len(expected))
    flat = np.fromfile(store.path / "tokens.bin", dtype=np.uint16)
    assert made and flat.tolist() == expected
    assert np.fromfile(store.path / "doc_index.bin", np.uint64).tolist() == ends
    assert store.tokens.shape == (len(expected) // 4, 4) and store.loss_mask is None
    assert store.tokens.reshape(-1).tolist() == expected[: len(expected) // 4 * 4]  # the tail is dropped
    meta = store.meta
    assert (meta["documents"], meta["tokens"], meta["seq_len"], meta["format"], meta["dtype"]) == \
        (3, len(expected), 4, "text", "uint16")
    assert meta["dataset_fingerprint"].startswith("files:") and len(meta["tokenizer_hash"]) == 64
    assert not (store.path / "loss_mask.bin").exists() and not list(store.path.glob("*.arrow"))
    again, made = prepare(spec, tok, 4, str(tmp_path / "stores"))
    assert not made and again.path == store.path
    assert dtype_for(len(tok)) == np.uint16 and dtype_for(2**16) == np.uint16 and dtype_for(2**16 + 1) == np.uint32


def test_key_follows_source_tokenizer_seq_len_and_format(tmp_path, tok):
    path = corpus(tmp_path)
    spec = DataSpec(str(path))
    first = store_path(store_key(spec, tok, 4), str(tmp_path))
    assert store_path(store_key(spec, tok, 8), str(tmp_path)) != first
    assert store_path(store_key(DataSpec(str(path), text_field="body"), tok, 4), str(tmp_path)) != first
    chat = DataSpec(str(path), format="chat")
    assert store_key(chat, chat_tokenizer("{{ 1 }}"), 4) != store_key(chat, chat_tokenizer("{{ 2 }}"), 4)
    path.write_text(path.read_text() + json.dumps({"text": "one more"}) + "\n")  # the file changed: new key
    assert store_path(store_key(spec, tok, 4), str(tmp_path)) != first


def test_partial_or_stale_stores_are_never_used(tmp_path, tok):
    spec, root = DataSpec(str(corpus(tmp_path, copies=5))), str(tmp_path / "stores")
    good, _ = prepare(spec, tok, 4, root)
    want = good.tokens.copy()
    key = store_key(spec, tok, 4)
    # a crashed preparation leaves only a .tmp folder, never the final name
    (good.path.parent / f".tmp-{good.path.name}-1-dead").mkdir()
    with open(good.path / "tokens.bin", "r+b") as f:  # truncated: wrong size for its meta
        f.truncate(10)
    assert open_store(good.path, key) is None
    rebuilt, made = prepare(spec, tok, 4, root)
    assert made and np.array_equal(rebuilt.tokens, want)
    meta = json.loads((good.path / "meta.json").read_text())
    meta["key"]["tokenizer_hash"] = "other"  # made for another key under this name: stale
    (good.path / "meta.json").write_text(json.dumps(meta))
    assert open_store(good.path, key) is None
    assert prepare(spec, tok, 4, root)[1]
    assert not [p for p in good.path.parent.iterdir() if p.name.startswith(".stale")]  # moved aside, then removed
    # two processes prepared the same store: the second to finish keeps the first one's (readers may map it)
    inode = (good.path / "tokens.bin").stat().st_ino
    late = good.path.parent / ".tmp-late"
    late.mkdir()
    storemod._publish(late, good.path, key)
    assert (good.path / "tokens.bin").stat().st_ino == inode and open_store(good.path, key) is not None


def test_failed_preparation_leaves_nothing(tmp_path, tok):
    root = tmp_path / "stores"
    with pytest.raises(UsageError, match="the dataset has 38 tokens, fewer than one block of seq_len=4096"):
        prepare(DataSpec(str(corpus(tmp_path))), tok, 4096, str(root))
    with pytest.raises(UsageError, match="has no chat template"):
        prepare(DataSpec(str(write_chat(tmp_path / "c.jsonl", 3)), format="chat"), tok, 8, str(root))
    assert [p.name[:6] for p in root.iterdir()] == [".lock-", ".lock-"]  # no store, no tmp folder


def test_parallel_and_streamed_preparation_write_the_same_bytes(tmp_path, tok, monkeypatch):
    spec = DataSpec(str(corpus(tmp_path, copies=50)))
    one, _ = prepare(spec, tok, 4, str(tmp_path / "a"), num_proc=1)
    monkeypatch.setattr(storemod, "MIN_DOCS_PER_PROC", 10)  # fork even for this small corpus
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")
    two, _ = prepare(spec, tok, 4, str(tmp_path / "b"), num_proc=2)
    streamed, _ = prepare(spec, tok, 4, str(tmp_path / "c"), num_proc=2, streaming=True)
    assert os.environ["TOKENIZERS_PARALLELISM"] == "true"  # workers ran on one thread each; the user's setting is back
    assert (two.meta["num_proc"], streamed.meta["streamed"]) == (2, True)
    raw = [(s.path / "tokens.bin").read_bytes() for s in (one, two, streamed)]
    assert raw[0] == raw[1] == raw[2]
    assert (one.path / "doc_index.bin").read_bytes() == (streamed.path / "doc_index.bin").read_bytes()


def test_a_launch_prepares_in_a_child_process_and_hears_its_errors(tmp_path, tok):
    """ensure_store on local rank 0 builds the store in a spawned process (so a training rank keeps none of what
    tokenizing allocated: bench/data.py measures it); the store is the one prepare() makes in-process, and a
    UsageError in the child reaches the rank as that UsageError (exit 2 with its message)."""
    from harness.data.store import ensure_store

    spec = DataSpec(str(corpus(tmp_path, copies=5)))
    store, made = ensure_store(spec, tok, 4, str(tmp_path / "child"), local_rank=0)
    assert made and store.path.parent == tmp_path / "child"
    again, made_again = ensure_store(spec, tok, 4, str(tmp_path / "child"), local_rank=1)  # a waiting rank
    assert not made_again and again.path == store.path
    local, _ = prepare(spec, tok, 4, str(tmp_path / "here"))
    assert np.array_equal(store.tokens, local.tokens) and store.meta["documents"] == local.meta["documents"]
    with pytest.raises(UsageError, match="fewer than one block of seq_len=4096"):
        ensure_store(spec, tok, 4096, str(tmp_path / "child"), local_rank=0)
