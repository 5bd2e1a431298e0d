"""Document packing (train.packing=document): position ids restart at each document, each document's first label
is -100, and the attention stays inside each document, so every document's per-token loss in a packed row equals
that document run alone (sdpa, eager, flex at sp=1; tiny Llama and Qwen2, fp32). concat keeps today's rows."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from helpers.corpora import write_instruction  # noqa: E402
from harness.data.corpus import DataSpec  # noqa: E402
from harness.data.rows import IGNORE_INDEX, Rows, model_inputs  # noqa: E402
from harness.data.store import prepare  # noqa: E402
from harness.model.hf import build_model, load_tokenizer  # noqa: E402

SEQ_LEN = 160
ROWS = 3  # rows checked per model and attention
SHARPEN = 8


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("docpack")
    spec = DataSpec(str(write_instruction(tmp / "i.jsonl", 40)), format="instruction")
    return prepare(spec, load_tokenizer("tiny-llama"), SEQ_LEN, str(tmp / "stores"))[0]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from helpers.models import qwen2_folder

    return {"llama": "tiny-llama", "qwen2": qwen2_folder(tmp_path_factory.mktemp("qwen2"))}


def _documents(store) -> list[tuple[int, int]]:
    """(start, end) offsets of every document in tokens.bin, from doc_index.bin as written."""
    ends = np.fromfile(store.path / "doc_index.bin", np.uint64).astype(np.int64).tolist()
    return list(zip([0] + ends[:-1], ends))


def test_positions_and_labels_follow_the_document_index(store):
    ids, labels, positions = Rows.of(store, "document").tensors()
    concat_ids, concat_labels = Rows.of(store, "concat").tensors()
    assert torch.equal(ids, concat_ids) and positions.dtype == torch.int64 and positions.shape == ids.shape
    flat_pos, flat_labels, flat_concat = positions.flatten(), labels.flatten(), concat_labels.flatten()
    total = ids.numel()
    starts = {s for s, _ in _documents(store) if s < total} | set(range(0, total, SEQ_LEN))  # rows restart too
    for s, e in _documents(store):
        for off in range(s, min(e, total)):
            row_start = off - off % SEQ_LEN
            assert flat_pos[off] == off - max(s, row_start)
    first = sorted(s for s, _ in _documents(store) if 0 < s < total and s % SEQ_LEN)
    assert first and (flat_labels[first] == IGNORE_INDEX).all()
    # everywhere else the labels are concat's (the loss mask): only document starts are added
    others = torch.ones(total, dtype=torch.bool)
    others[first] = False
    assert torch.equal(flat_labels[others], flat_concat[others])
    assert set(torch.nonzero(flat_pos == 0).flatten().tolist()) == starts


def test_concat_rows_are_todays_rows_bit_for_bit(store):
    """concat: the store's tokens and loss mask exactly, as before document packing existed."""
    ids, labels = Rows.of(store).tensors()
    tokens = np.fromfile(store.path / "tokens.bin", store.meta["dtype"])[:ids.numel()].reshape(ids.shape)
    mask = np.fromfile(store.path / "loss_mask.bin", np.uint8)[:ids.numel()].reshape(ids.shape).astype(bool)
    assert np.array_equal(ids.numpy(), tokens.astype(np.int64))
    assert np.array_equal(labels.numpy(), np.where(mask, tokens.astype(np.int64), IGNORE_INDEX))


def _token_losses(model, batch) -> torch.Tensor:
    """Per-token loss [n, S-1] of a batch (labels shifted by one, -100 -> 0); no attention_mask, no cache."""
    inputs = model_inputs(batch)
    labels = inputs.pop("labels")
    logits = model(**inputs, use_cache=False).logits.float()
    return torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:],
                                             ignore_index=IGNORE_INDEX, reduction="none")


def _sharp(model):
    """Weights x SHARPEN: a freshly initialised tiny model predicts nearly uniformly whatever it attends to, so a
    leak across documents would move its loss by less than any tolerance; sharpened, it moves it by whole units."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(SHARPEN)
    return model


def _segments(positions: torch.Tensor) -> list[tuple[int, int]]:
    starts = torch.nonzero(positions == 0).flatten().tolist() + [positions.numel()]
    return list(zip(starts[:-1], starts[1:]))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("attention", ["sdpa", "eager", "flex_attention"])
def test_each_document_in_a_packed_row_has_its_own_loss(store, models, family, attention):
    model = _sharp(build_model(models[family], seed=7).float().eval())
    model.set_attn_implementation(attention)
    ids, labels, positions = Rows.of(store, "document")[:ROWS].tensors()
    with torch.no_grad():  # flex_attention has no backward on CPU (the refusal in harness/model/attention.py)
        packed = _token_losses(model, (ids, labels, positions))
        leaked = _token_losses(model, (ids, labels))  # concat: the same rows attending across documents
        checked = differs = 0
        for r in range(ROWS):
            for s, e in _segments(positions[r]):
                alone = _token_losses(model, (ids[r:r + 1, s:e], labels[r:r + 1, s:e]))[0]
                assert labels[r, s] == IGNORE_INDEX or s == 0  # the first label of a document
                torch.testing.assert_close(packed[r, s:e - 1], alone, rtol=0, atol=2e-5)
                checked += e - s - 1
                gap = (leaked[r, s:e - 1] - alone).abs().max().item() if e - s > 1 else 0.0
                differs += int(s > 0 and gap > 0.1)
    print(family, attention, "checked", checked, "differs", differs, "packed loss", packed.sum().item())
    assert checked > ROWS * SEQ_LEN // 2 and differs >= ROWS  # concat's losses really differ: the check can fail
