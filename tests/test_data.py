"""Data loading, packing, caching and splitting, with real datasets and the shipped tokenizer."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from harness.train import data  # noqa: E402
from harness.train.batches import BatchPlan  # noqa: E402
from harness.errors import UsageError  # noqa: E402
from harness.model_shapes import TINY_VOCAB_SIZE  # noqa: E402
from harness.train.models import load_tokenizer  # noqa: E402

DOCS = ["The cat eats fish.", "A dog barks at the gate.", "Monday, Tuesday, Wednesday."]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny-llama")


@pytest.fixture(scope="module")
def builtin_blocks(tmp_path_factory, tok):
    cache = tmp_path_factory.mktemp("pack_cache")
    return data.tokenize_and_pack(data.load_text_dataset("builtin"), tok, 128, str(cache))


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
    ds = data.load_text_dataset(str(tmp_path / name), text_field=field)
    assert ds.column_names == ["text"]
    assert ds["text"] == DOCS


def test_folder_of_files_loads_all_of_them(tmp_path):
    for i, doc in enumerate(DOCS):
        (tmp_path / f"part{i}.jsonl").write_text(json.dumps({"text": doc}) + "\n")
    assert data.load_text_dataset(str(tmp_path))["text"] == DOCS


def test_folder_mixing_kinds_is_refused(tmp_path):
    write_files(tmp_path)
    with pytest.raises(UsageError, match=r"(?s)mixes file kinds \(csv, json, parquet, text\).*fix: keep one kind"):
        data.load_text_dataset(str(tmp_path))


def test_missing_text_field_lists_the_columns(tmp_path):
    write_files(tmp_path)
    with pytest.raises(UsageError) as err:
        data.load_text_dataset(str(tmp_path / "d.csv"))
    assert "has no column 'text'; its columns are: id, body" in str(err.value)
    assert "fix: pass the text column's name as text_field" in str(err.value)


def test_unsupported_extension_lists_supported_ones(tmp_path):
    (tmp_path / "d.xml").write_text("<doc/>")
    with pytest.raises(UsageError, match=r"extension '\.xml'.*\n.*\.txt, \.json, \.jsonl, \.csv, \.parquet"):
        data.load_text_dataset(str(tmp_path / "d.xml"))


def test_missing_file_and_unreachable_hub_id_say_what_to_do(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        data.load_text_dataset(str(tmp_path / "nope.jsonl"))
    with pytest.raises(UsageError, match="Hub lookup failed.*\n.*fix: use 'builtin'"):
        data.load_text_dataset("no-such-org/no-such-dataset")


def test_builtin_corpus_loads():
    ds = data.load_text_dataset("builtin")
    assert ds.column_names == ["text"] and len(ds) > 3000
    assert data.BUILTIN_CORPUS.stat().st_size < 3_000_000


def test_packing_joins_documents_with_eos_and_drops_the_tail(tok):
    import datasets

    ds = datasets.Dataset.from_dict({"text": DOCS})
    expected = []
    for doc in DOCS:
        expected += tok(doc, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    blocks = data.tokenize_and_pack(ds, tok, seq_len=4, cache_dir=None)
    assert blocks.dtype == torch.long and blocks.shape == (len(expected) // 4, 4)
    assert blocks.flatten().tolist() == expected[: blocks.numel()]


def test_builtin_blocks_shape_and_vocab(builtin_blocks):
    assert builtin_blocks.dtype == torch.long and builtin_blocks.shape[1] == 128
    assert builtin_blocks.shape[0] > 5000
    assert 0 <= int(builtin_blocks.min()) and int(builtin_blocks.max()) < TINY_VOCAB_SIZE


def test_pack_cache_is_written_and_reused(tmp_path, tok):
    ds = data.load_text_dataset("builtin")
    path = data.pack_cache_path(ds, tok, 64, str(tmp_path))
    assert path is not None and str(path).startswith(str(tmp_path)) and not path.exists()
    first = data.tokenize_and_pack(ds, tok, 64, str(tmp_path))
    assert path.is_file()
    second = data.tokenize_and_pack(data.load_text_dataset("builtin"), tok, 64, str(tmp_path))
    assert torch.equal(first, second)
    # the key depends on seq_len, so another length is another file
    assert data.pack_cache_path(ds, tok, 128, str(tmp_path)) != path


def test_in_memory_datasets_leave_no_cache(tmp_path, tok):
    import datasets

    ds = datasets.Dataset.from_dict({"text": DOCS * 20})
    assert data.pack_cache_path(ds, tok, 8, str(tmp_path)) is None
    data.tokenize_and_pack(ds, tok, 8, str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_too_little_text_for_one_block(tok):
    import datasets

    with pytest.raises(UsageError, match="fewer than one block of seq_len=4096"):
        data.tokenize_and_pack(datasets.Dataset.from_dict({"text": DOCS}), tok, 4096, None)


def test_builtin_corpus_covers_200_steps_of_batch_16(builtin_blocks):
    """The demo (200 steps x 16 rows x 128 tokens) must not loop over the corpus many times."""
    train, _ = data.split_blocks(builtin_blocks, 0.05, seed=0)
    plan = BatchPlan(num_rows=len(train), global_batch=16, micro_batch=16, grad_accum=1)
    epochs_needed = 200 / plan.steps_per_epoch
    print(f"builtin: {len(builtin_blocks)} blocks of 128, {len(train)} train -> "
          f"{plan.steps_per_epoch} steps/epoch; 200 steps = {epochs_needed:.2f} epochs")
    assert epochs_needed <= 1.0


def test_split_is_deterministic_disjoint_and_complete():
    blocks = torch.arange(100 * 3).view(100, 3)
    train, evals = data.split_blocks(blocks, 0.1, seed=1)
    train2, evals2 = data.split_blocks(blocks, 0.1, seed=1)
    assert torch.equal(train, train2) and torch.equal(evals, evals2)
    assert len(evals) == 10 and len(train) == 90
    rows = sorted(train[:, 0].tolist() + evals[:, 0].tolist())
    assert rows == list(range(0, 300, 3))
    assert not torch.equal(data.split_blocks(blocks, 0.1, seed=2)[1], evals)


def test_split_edge_cases():
    blocks = torch.zeros(10, 4, dtype=torch.long)
    assert len(data.split_blocks(blocks, 0.001, seed=0)[1]) == 1  # at least one eval block
    train, evals = data.split_blocks(blocks, 0.0, seed=0)
    assert len(train) == 10 and len(evals) == 0
    with pytest.raises(ValueError, match=r"eval_fraction must be in \[0, 1\)"):
        data.split_blocks(blocks, 1.0, seed=0)
    with pytest.raises(ValueError, match="leaves no training blocks"):
        data.split_blocks(torch.zeros(1, 4), 0.5, seed=0)
