"""The served teacher (harness/distill/served.py) against the test's own server on 127.0.0.1 (a real tiny HF model
behind vLLM's /v1/completions with prompt_logprobs: tests/helpers/teacher_server.py): it equals the precomputed
store with the same k, and the loss from either is the same; a server that hangs mid-run ends it with the
reason in bounded time (TeacherUnavailable: an outage, exit 69, which the launchers retry), and no store is
published; a request the server refuses (a 4xx) is bad input (TeacherServerError, exit 2), not retried."""

from __future__ import annotations

import time

import pytest
import torch

from harness.dist import free_port
from harness.distill.served import ServedTeacher, TeacherServerError, TeacherUnavailable
from harness.distill.teacher_store import ensure_teacher_store, store_key, store_path
from harness.distill.topk_loss import topk_loss_sum
from harness.errors import UsageError
from tests.helpers.distill_rows import batch_fn, local_teacher, rows
from tests.helpers.models import qwen2_folder
from tests.helpers.teacher_server import serve, start as start_server

NUM_ROWS, K, T = 5, 3, 0.9


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    return qwen2_folder(tmp_path_factory.mktemp("teacher") / "qwen2")


def write(folder, teacher, k=K, micro=2):
    ids, labels = rows(NUM_ROWS)
    key = store_key(teacher="t", weights=[], data={"seq_len": 24}, k=k, temperature=T, precision="fp32")
    return ensure_teacher_store(store_path(folder, key), key, num_rows=NUM_ROWS, batch=batch_fn(ids, labels),
                                teacher=teacher, micro=micro, vocab_size=512)


def test_served_equals_precomputed_with_the_same_k(teacher_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(teacher_dir, torch_dtype=torch.float32).eval()
    local, _ = write(tmp_path / "local", local_teacher(model, K, T))
    server = serve(teacher_dir)
    try:
        served = ServedTeacher(f"http://127.0.0.1:{server.server_address[1]}", K, T, timeout_s=30).connect()
        assert served.model == str(teacher_dir)
        remote, _ = write(tmp_path / "served", served)
        ids, labels = rows(NUM_ROWS)
        direct = served(torch.from_numpy(ids[:3]), torch.from_numpy(labels[:3]))  # one request, three rows
    finally:
        server.shutdown()
    everything = range(NUM_ROWS)
    a, b = local.rows(everything), remote.rows(everything)
    assert len(a) == int((labels[:, 1:] != -100).sum()) > 0
    assert torch.equal(a.ids, b.ids)
    torch.testing.assert_close(b.logps, a.logps, rtol=0, atol=1e-5)
    torch.testing.assert_close(b.actual, a.actual, rtol=0, atol=1e-5)
    assert torch.equal(direct.ids, a.ids[:len(direct)])
    student = torch.randn(NUM_ROWS, ids.shape[1], 512, generator=torch.Generator().manual_seed(3))
    for k_loss in (a, b):
        assert k_loss.ids.dtype == torch.int64 and k_loss.logps.dtype == torch.float32
    loss_a = topk_loss_sum(student, torch.from_numpy(labels), a, beta=0.0, temperature=T)
    loss_b = topk_loss_sum(student, torch.from_numpy(labels), b, beta=0.0, temperature=T)
    assert float(loss_a) == pytest.approx(float(loss_b), rel=1e-5) and float(loss_a) > 0


def test_a_server_that_hangs_mid_run_ends_it_with_the_reason(teacher_dir, tmp_path):
    """(One that dies mid-run ends a real 2-rank run: tests/test_distill_topk_run.py.)"""
    port = free_port()
    proc = start_server(teacher_dir, port, "--hang-after", "1")
    try:
        served = ServedTeacher(f"http://127.0.0.1:{port}", K, T, timeout_s=3, retries=1).connect()
        started = time.monotonic()
        with pytest.raises(TeacherUnavailable) as err:
            write(tmp_path, served, micro=1)  # the first micro-batch is answered, the second is not
        took = time.monotonic() - started
    finally:
        proc.kill()
        proc.wait()
    text = str(err.value)
    assert not issubclass(TeacherUnavailable, UsageError)  # harness/train/job.py: exit 69, not 2 (bad input)
    assert f"http://127.0.0.1:{port}/v1/completions" in text and "after 2 attempt(s)" in text, text
    assert "timed out" in text, text
    assert "fix: check that the server is up" in text
    assert took < 3 * 2 + 0.5 + 20, took  # two 3 s timeouts and a 0.5 s backoff (+ the first answer), not a hang
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith("teacher_topk")]  # nothing published


def test_a_server_that_is_not_there_is_named_before_training(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(TeacherUnavailable, match=r"no health answer after 1 attempt\(s\).*Connection refused"):
        ServedTeacher(url, K, T, timeout_s=1, retries=0).connect()


def test_a_request_the_server_refuses_is_bad_input_and_not_retried(teacher_dir):
    server = serve(teacher_dir)
    try:
        served = ServedTeacher(f"http://127.0.0.1:{server.server_address[1]}", K, T, timeout_s=30, retries=3).connect()
        served.model = "another-model"  # the server answers 404: that model does not exist
        ids, labels = rows(2)
        with pytest.raises(TeacherServerError) as err:
            served(torch.from_numpy(ids), torch.from_numpy(labels))
    finally:
        server.shutdown()
    assert issubclass(TeacherServerError, UsageError)  # harness/run.py: exit 2, the message, no traceback
    assert "after 1 attempt(s)" in str(err.value) and "HTTP 404" in str(err.value), err.value
    assert "--max-logprobs" in str(err.value)
