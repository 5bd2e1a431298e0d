"""The top-k teacher modes through the real distillation step (train.objective gkd) on 2 DeepSpeed ranks, against
the top-k (+ tail) formula in plain torch (tests/helpers/topk_ref.py): a 1-layer Llama student, a 2-layer sharpened
Llama teacher with the same tokenizer, 8 prompt-completion records of unequal lengths, 2 ranks x 2 rows x 2
accumulation steps = every record in each step (so the step's loss does not depend on which rank took which row),
SGD lr 1, no clipping. The first step's loss and grad norm and the SECOND step's loss (which shows the update)
equal the formula's:
  - precomputed, ZeRO-3 (the store written by a ZeRO-3 teacher engine, then freed), k 4, beta 0, T 0.9;
  - precomputed, ddp, k 1, beta 0.5 (TRL's top-1 support: the teacher's top-1 and the actual token), T 1;
  - the first case again in a new run folder: the store is read, no teacher is built, the same losses;
  - served, ZeRO-2, k 4, beta 0, T 0.9, against the test's own server on 127.0.0.1: the precomputed run's losses;
  - served with a server that dies after its first answer: the run ends with exit 69 (an outage, which the
    launchers retry) and the reason on rank 0, no step trained.
All in ONE 2-rank launch, shared with the other distillation tests (tests/helpers/distill_launch.py). Then the
refusals before launch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from harness.cli import main
from harness.train.preempt import EXIT_TEACHER_UNAVAILABLE
from helpers.distill_launch import LR, SEQ_LEN, TOPK_CASES, TOPK_STEPS
from helpers.launch import records
from helpers.topk_ref import topk_reference_sum

RTOL, ATOL = 1e-5, 1e-6
STEPS, CASES = TOPK_STEPS, TOPK_CASES


@pytest.fixture(scope="module")
def launched(distill_runs):
    """(the top-k cases' root, the shared launch: conftest's distill_runs)."""
    return distill_runs.root / "topk", distill_runs


def expected(root: Path, k: int, beta: float, temperature: float) -> list[dict]:
    """Each step's loss and grad norm from the formula: every record in each step, SGD between them."""
    from transformers import AutoModelForCausalLM

    from harness.model.hf import load_tokenizer
    from harness.train.distill_data import encode_records

    records_ = [json.loads(line) for line in (root / "data.jsonl").read_text().splitlines()]
    rows, _ = encode_records(records_, "data", load_tokenizer(str(root / "student")), SEQ_LEN)
    input_ids, labels = rows.tensors()[:2]
    student = AutoModelForCausalLM.from_pretrained(root / "student", torch_dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(root / "teacher", torch_dtype=torch.float32).eval()
    with torch.no_grad():
        teacher_logits = teacher(input_ids=input_ids).logits
    tokens = int((labels[:, 1:] != -100).sum())
    out = []
    for _ in range(STEPS):
        student.zero_grad()
        loss = topk_reference_sum(student(input_ids=input_ids).logits, teacher_logits, labels, k, beta,
                                  temperature, True) / tokens
        loss.backward()
        grads = [p.grad for p in student.parameters() if p.grad is not None]
        norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads))
        out.append({"loss": float(loss.detach()), "grad_norm": float(norm)})
        with torch.no_grad():
            for p in student.parameters():
                p -= LR * p.grad
    return out


def close(name: str, got, want) -> None:
    assert abs(got - want) <= RTOL * abs(want) + ATOL, f"{name}: {got} vs {want}"


@pytest.mark.multirank
def test_precomputed_and_served_equal_the_top_k_formula_through_the_step(launched):
    root, runs = launched
    print(f"the shared 2-rank launch of {len(runs.names)} cases: {runs.seconds:.0f} s")
    for name, (_, mode, k, beta, temperature) in CASES.items():
        got = records(root / name, "train")
        want = expected(root, k, beta, temperature)[:len(got)]
        assert len(got) == (1 if name.endswith("again") else STEPS), got
        for step, (g, w) in enumerate(zip(got, want), 1):
            close(f"{name} step {step} loss", g["loss"], w["loss"])
            if g.get("grad_norm") is not None:
                close(f"{name} step {step} grad_norm", g["grad_norm"], w["grad_norm"])
        if len(got) > 1:
            assert got[1]["loss"] < got[0]["loss"]  # the update moved the student toward the teacher
    assert "(written in" in runs.out("precomputed_zero3_k4") and "teacher engine of" in runs.out("precomputed_zero3_k4")
    assert "(read, no teacher built)" in runs.out("precomputed_zero3_k4_again")
    served = runs.out("served_zero2_k4")
    assert "served by http://127.0.0.1:" in served and "top-4 prompt log-probs" in served
    first = records(root / "precomputed_zero3_k4", "train")
    assert records(root / "precomputed_zero3_k4_again", "train")[0]["loss"] == first[0]["loss"]


@pytest.mark.multirank
def test_a_server_that_dies_mid_run_ends_it_with_exit_69_and_the_reason(launched):
    """The case's expected exit code, 69, is checked by the launch's driver (tests/drivers/jobs.py: a case
    {"argv", "code": 69} that exits otherwise fails the launch); job.run returned it on every rank."""
    root, runs = launched
    err = runs.out("served_dies", "stderr")
    assert EXIT_TEACHER_UNAVAILABLE == 69 and runs.proc.returncode == 0
    assert "error: rank " in err and "the served teacher gave no prompt log-probs after 2 attempt(s)" in err and \
        f"127.0.0.1:{runs.dies_port}/v1/completions" in err and "exit 69" in err, err[-3000:]
    assert "Traceback" not in err
    assert not records(root / "served_dies", "train")  # the step the server died in is not logged as trained


@pytest.mark.parametrize("block,message", [
    ({"teacher_mode": "precomputed", "lmbda": 0.5}, "teacher_mode precomputed with on-policy"),
    ({"teacher_mode": "precomputed", "lmbda": 0, "seq_kd": True}, "teacher_mode precomputed with on-policy"),
    ({"teacher_mode": "precomputed", "lmbda": 0, "beta": 0.5, "loss_top_k": 8},
     "loss_top_k 8 with beta 0.5 > 0 and teacher_mode precomputed: the precomputed store holds only"),
    ({"teacher_model_server_url": "http://127.0.0.1:9", "lmbda": 0, "beta": 1, "loss_top_k": 2},
     "loss_top_k 2 with beta 1 > 0 and teacher_mode served: the server returns only"),
    ({"teacher_mode": "served", "lmbda": 0}, "teacher_mode served with no teacher server"),
    ({"teacher_mode": "engine", "lmbda": 0, "teacher_model_server_url": "http://127.0.0.1:9"},
     "with teacher_mode engine: the URL is read only by the served teacher"),
])
def test_top_k_teachers_are_refused_before_launch_with_the_reason(tmp_path, capsys, block, message):
    path = tmp_path / "recipe.json"
    path.write_text(json.dumps({"description": "kd", "train": {"objective": "gkd"}, "distill": block}))
    assert main(["validate", str(path), "--world-size", "2"]) == 2
    err = capsys.readouterr().err
    assert message in err and "fix:" in err, err
