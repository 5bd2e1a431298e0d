"""The precomputed teacher store (harness/distill/teacher_store.py): written once by a real tiny teacher's forward,
equal to the teacher's top-k on every row, read (not recomputed) the second time, rebuilt when stale; written by 2
real DeepSpeed ranks through a ZeRO-3 teacher engine with the rows split unevenly (in the distillation tests' shared
launch), byte for byte the one-process store."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from harness.distill.teacher_store import bytes_per_token, ensure_teacher_store, open_teacher_store, store_key, \
    store_path
from helpers.distill_launch import STORE_K, STORE_ROWS, STORE_T
from tests.helpers.distill_rows import batch_fn, local_teacher, rows
from tests.helpers.models import qwen2_folder

NUM_ROWS, K, T = STORE_ROWS, STORE_K, STORE_T  # the shared launch's store case's


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    return qwen2_folder(tmp_path_factory.mktemp("teacher") / "qwen2")


def key_for(teacher_dir, k=K, temperature=T):
    return store_key(teacher=str(teacher_dir), weights=["test"], data={"seq_len": 24}, k=k,
                     temperature=temperature, precision="fp32")


def write(teacher_dir, folder, teacher=None, k=K):
    from transformers import AutoModelForCausalLM

    ids, labels = rows(NUM_ROWS)
    if teacher is None:
        model = AutoModelForCausalLM.from_pretrained(teacher_dir, torch_dtype=torch.float32).eval()
        teacher = local_teacher(model, k, T)
    key = key_for(teacher_dir, k)
    return ensure_teacher_store(store_path(folder, key), key, num_rows=NUM_ROWS, batch=batch_fn(ids, labels),
                                teacher=teacher, micro=3, vocab_size=512)


def must_not_run(*_):
    raise AssertionError("the teacher ran although the store was there")


def test_store_holds_the_teachers_top_k_and_is_read_the_second_time(teacher_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    store, written = write(teacher_dir, tmp_path)
    assert written
    ids, labels = rows(NUM_ROWS)
    model = AutoModelForCausalLM.from_pretrained(teacher_dir, torch_dtype=torch.float32).eval()
    for r in range(NUM_ROWS):  # each row alone, unpadded by others: the store's batched values equal it
        want = local_teacher(model, K, T)(torch.from_numpy(ids[r:r + 1]), torch.from_numpy(labels[r:r + 1]))
        got = store.rows([r])
        assert torch.equal(got.ids, want.ids)
        torch.testing.assert_close(got.logps, want.logps, rtol=0, atol=1e-5)
        torch.testing.assert_close(got.actual, want.actual, rtol=0, atol=1e-5)
    both = store.rows([5, 2])  # rows in the order asked
    assert torch.equal(both.ids, torch.cat([store.rows([5]).ids, store.rows([2]).ids]))
    tokens = int((labels[:, 1:] != -100).sum())
    assert store.meta["tokens"] == tokens and store.meta["rows"] == NUM_ROWS
    assert bytes_per_token(K, 512) == K * (2 + 4) + 4 == store.meta["bytes_per_token"]
    on_disk = sum(p.stat().st_size for p in store.path.glob("*.bin"))
    assert on_disk == tokens * store.meta["bytes_per_token"] + (NUM_ROWS + 1) * 8

    again, written = write(teacher_dir, tmp_path, teacher=must_not_run)
    assert not written and again.path == store.path
    assert torch.equal(again.rows(range(NUM_ROWS)).ids, store.rows(range(NUM_ROWS)).ids)


def test_another_key_or_a_broken_store_is_written_anew(teacher_dir, tmp_path):
    store, _ = write(teacher_dir, tmp_path)
    other_k, written = write(teacher_dir, tmp_path, k=1)
    assert written and other_k.path != store.path and other_k.ids.shape[1] == 1
    assert open_teacher_store(store.path, key_for(teacher_dir, temperature=1.0)) is None  # another key: not read
    with open(store.path / "logps.bin", "r+b") as f:  # a truncated file: not read, rebuilt
        f.truncate(8)
    assert open_teacher_store(store.path, key_for(teacher_dir)) is None
    rebuilt, written = write(teacher_dir, tmp_path)
    assert written and rebuilt.path == store.path
    assert json.loads((store.path / "meta.json").read_text())["tokens"] == rebuilt.meta["tokens"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left behind


@pytest.mark.multirank
def test_two_ranks_with_a_zero3_teacher_write_the_one_process_store(distill_runs, tmp_path):
    """The ranked store is written by tests/drivers/teacher_store.py's `write` in the distillation tests' shared
    2-rank launch (tests/helpers/distill_launch.py)."""
    teacher_dir = distill_runs.root / "store" / "qwen2"
    assert "written True read True" in distill_runs.out("store_zero3"), distill_runs.out("store_zero3")[-3000:]
    alone, _ = write(teacher_dir, tmp_path / "alone")
    key = key_for(teacher_dir)
    two = open_teacher_store(store_path(distill_runs.root / "store" / "ranked", key), key)
    assert two is not None and two.meta["ranks"] == 2
    assert np.array_equal(two.row_index, alone.row_index) and np.array_equal(two.ids, alone.ids)
    np.testing.assert_allclose(two.logps, alone.logps, rtol=0, atol=1e-5)
    np.testing.assert_allclose(two.actual, alone.actual, rtol=0, atol=1e-5)
