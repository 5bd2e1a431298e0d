"""Data loading, column checks, hub errors, and the train/eval split of store rows, with real datasets."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from harness.data import corpus as data  # noqa: E402
from harness.data.batches import BatchPlan  # noqa: E402
from harness.errors import UsageError  # noqa: E402
from harness.model_shapes import TINY_VOCAB_SIZE  # noqa: E402
from harness.model.hf import load_tokenizer  # noqa: E402
from harness.data.rows import Rows, split_rows  # noqa: E402
from harness.data.store import prepare  # noqa: E402

DOCS = ["The cat eats fish.", "A dog barks at the gate.", "Monday, Tuesday, Wednesday."]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny-llama")


@pytest.fixture(scope="module")
def builtin_blocks(tmp_path_factory, tok):
    store, _ = prepare(data.DataSpec(), tok, 128, str(tmp_path_factory.mktemp("stores")))
    return Rows.of(store)


def load_text_dataset(dataset: str, text_field: str = "text"):
    """The records a text run reads (corpus.load_dataset_for), with the text column named "text"."""
    ds = data.load_dataset_for(data.DataSpec(dataset=dataset, text_field=text_field))
    return ds.rename_column(text_field, "text") if text_field != "text" else ds


def write_files(folder):
    """The same three documents in every supported format."""
    import pandas as pd

    (folder / "d.txt").write_text("\n".join(DOCS) + "\n")
    (folder / "d.jsonl").write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(DOCS)))
    (folder / "d.json").write_text(json.dumps([{"text": d} for d in DOCS]))
    pd.DataFrame({"id": range(3), "body": DOCS}).to_csv(folder / "d.csv", index=False)
    pd.DataFrame({"text": DOCS}).to_parquet(folder / "d.parquet")


@pytest.mark.parametrize("name,field", [("d.txt", "text"), ("d.jsonl", "text"), ("d.json", "text"),
                                        ("d.csv", "body"), ("d.parquet", "text")])
def test_local_files_load_as_one_text_column(tmp_path, name, field):
    write_files(tmp_path)
    ds = load_text_dataset(str(tmp_path / name), text_field=field)
    assert ds.column_names == ["text"]
    assert ds["text"] == DOCS


def test_folder_of_files_loads_all_of_them(tmp_path):
    for i, doc in enumerate(DOCS):
        (tmp_path / f"part{i}.jsonl").write_text(json.dumps({"text": doc}) + "\n")
    assert load_text_dataset(str(tmp_path))["text"] == DOCS


def test_folder_mixing_kinds_is_refused(tmp_path):
    write_files(tmp_path)
    with pytest.raises(UsageError, match=r"(?s)mixes file kinds \(csv, json, parquet, text\).*fix: keep one kind"):
        load_text_dataset(str(tmp_path))


def test_missing_text_field_lists_the_columns(tmp_path):
    write_files(tmp_path)
    with pytest.raises(UsageError) as err:
        load_text_dataset(str(tmp_path / "d.csv"))
    assert "has no column 'text' (train.text_field, format 'text'); its columns are: id, body" in str(err.value)
    assert "fix: set train.text_field to the column that holds it" in str(err.value)


def test_unsupported_extension_lists_supported_ones(tmp_path):
    (tmp_path / "d.xml").write_text("<doc/>")
    with pytest.raises(UsageError, match=r"extension '\.xml'.*\n.*\.txt, \.json, \.jsonl, \.csv, \.parquet"):
        load_text_dataset(str(tmp_path / "d.xml"))


def test_missing_file_and_unreachable_hub_id_say_what_to_do(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        load_text_dataset(str(tmp_path / "nope.jsonl"))
    with pytest.raises(UsageError, match="Hub lookup failed.*\n.*fix: use 'builtin'"):
        load_text_dataset("no-such-org/no-such-dataset")
    with pytest.raises(UsageError) as err:  # offline: the id, config and split are named, and what to do
        data.load_dataset_for(data.DataSpec("no-such-org/chat-set", config="en", split="test", format="chat"))
    assert "cannot load dataset no-such-org/chat-set (config 'en') split 'test'" in str(err.value)
    assert "unset HF_DATASETS_OFFLINE/HF_HUB_OFFLINE and check the id, train.dataset_config" in str(err.value)


def test_builtin_corpus_loads():
    ds = load_text_dataset("builtin")
    assert ds.column_names == ["text"] and len(ds) > 3000
    assert data.BUILTIN_CORPUS.stat().st_size < 3_000_000


def test_builtin_corpus_covers_200_steps_of_batch_16(builtin_blocks):
    """The demo (200 steps x 16 rows x 128 tokens) must not loop over the corpus many times."""
    train, _ = split_rows(builtin_blocks, 0.05, seed=0)
    plan = BatchPlan(num_rows=len(train), global_batch=16, micro_batch=16, grad_accum=1)
    epochs_needed = 200 / plan.steps_per_epoch
    print(f"builtin: {len(builtin_blocks)} blocks of 128, {len(train)} train -> "
          f"{plan.steps_per_epoch} steps/epoch; 200 steps = {epochs_needed:.2f} epochs")
    assert epochs_needed <= 1.0


def _rows(array) -> Rows:
    return Rows(array, None, np.arange(len(array)))


def test_split_is_deterministic_disjoint_and_complete():
    blocks = np.arange(100 * 3).reshape(100, 3)
    train, evals = split_rows(_rows(blocks), 0.1, seed=1)
    train2, evals2 = split_rows(_rows(blocks), 0.1, seed=1)
    assert np.array_equal(train.index, train2.index) and np.array_equal(evals.index, evals2.index)
    assert len(evals) == 10 and len(train) == 90
    rows = sorted(train.tensors()[0][:, 0].tolist() + evals.tensors()[0][:, 0].tolist())
    assert rows == list(range(0, 300, 3))
    assert not np.array_equal(split_rows(_rows(blocks), 0.1, seed=2)[1].index, evals.index)


def test_split_edge_cases():
    blocks = np.zeros((10, 4), dtype=np.uint16)
    assert len(split_rows(_rows(blocks), 0.001, seed=0)[1]) == 1  # at least one eval block
    train, evals = split_rows(_rows(blocks), 0.0, seed=0)
    assert len(train) == 10 and len(evals) == 0
    with pytest.raises(ValueError, match=r"eval_fraction must be in \[0, 1\)"):
        split_rows(_rows(blocks), 1.0, seed=0)
    with pytest.raises(ValueError, match="leaves no training rows"):
        split_rows(_rows(blocks[:1]), 0.5, seed=0)


def test_rows_are_views_and_read_only_what_is_asked(builtin_blocks):
    """A view of a view is an index over the same memory map; tensors() is a LongTensor [n, seq_len]."""
    assert isinstance(builtin_blocks.tokens, np.memmap) and builtin_blocks.tokens.dtype == np.uint16
    train, evals = split_rows(builtin_blocks, 0.05, seed=0)
    assert train.tokens is builtin_blocks.tokens and evals.tokens is builtin_blocks.tokens
    picked = train[torch.tensor([5, 0, 5])]
    ids, labels = picked.tensors()
    assert ids.dtype == torch.long and ids.shape == (3, 128) and labels is ids  # text: every token is a target
    assert torch.equal(ids[0], ids[2])
    assert torch.equal(ids[1], torch.from_numpy(builtin_blocks.tokens[train.index[0]].astype(np.int64)))
    strided = evals[1::2][:3]
    assert strided.shape == (3, 128) and list(strided.index) == list(evals.index[1::2][:3])
    assert 0 <= int(ids.min()) and int(ids.max()) < TINY_VOCAB_SIZE
