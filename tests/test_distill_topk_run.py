"""The top-k teacher modes through the real distillation step (train.objective gkd) on 2 DeepSpeed ranks, against
the top-k (+ tail) formula in plain torch (tests/helpers/topk_ref.py): a 1-layer Llama student, a 2-layer sharpened
Llama teacher with the same tokenizer, 8 prompt-completion records of unequal lengths, 2 ranks x 2 rows x 2
accumulation steps = every record in each step (so the step's loss does not depend on which rank took which row),
SGD lr 1, no clipping. The first step's loss and grad norm and the SECOND step's loss (which shows the update)
equal the formula's:
  - precomputed, ZeRO-3 (the store written by a ZeRO-3 teacher engine, then freed), k 4, beta 0, T 0.9;
  - precomputed, ddp, k 1, beta 0.5 (TRL's top-1 support: the teacher's top-1 and the actual token), T 1;
  - the first case again in a new run folder: the store is read, no teacher is built, the same losses;
  - served, ZeRO-2, k 4, beta 0, T 0.9, against the test's own server on 127.0.0.1: the precomputed run's losses.
All in ONE 2-rank launch. Then a served run whose server dies after its first answer ends with exit 2 and the
reason on rank 0, in bounded time, and the refusals before launch."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest
import torch

from harness.cli import main
from harness.dist import free_port
from tests.helpers.launch import job_output, launch, launch_jobs, records
from tests.helpers.models import llama_folder
from tests.helpers.teacher_server import serve, start as start_server
from tests.helpers.topk_ref import topk_reference_sum

STEPS, SEQ_LEN, LR, NUM_RECORDS = 2, 24, 1.0, 8
RTOL, ATOL = 1e-5, 1e-6
WORDS = "alpha beta gamma delta river stone cloud green seven quiet paper music light north".split()
CASES = {  # name: (recipe, teacher mode, k, beta, loss temperature)
    "precomputed_zero3_k4": ("zero3", "precomputed", 4, 0.0, 0.9),
    "precomputed_ddp_k1_jsd": ("ddp", "precomputed", 1, 0.5, 1.0),
    "precomputed_zero3_k4_again": ("zero3", "precomputed", 4, 0.0, 0.9),
    "served_zero2_k4": ("zero2", "served", 4, 0.0, 0.9),
}


def write_records(path: Path) -> Path:
    rng = random.Random(5)
    phrase = lambda lo, hi: " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))  # noqa: E731
    path.write_text("".join(json.dumps({"prompt": phrase(2, 5), "completion": " " + phrase(1, 9)}) + "\n"
                            for _ in range(NUM_RECORDS)))
    return path


def sharpen(folder: str, scale: float = 6.0) -> str:
    """The folder's output head scaled in place: a peaked teacher, far from the random student."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(scale)
    model.save_pretrained(folder)
    return folder


def argv(root: Path, name: str, url: str = "", steps: int = STEPS, timeout_s: float = 60, retries: int = 2) -> list:
    recipe, mode, k, beta, temperature = CASES.get(name, CASES["served_zero2_k4"])
    sets = {"precision": "fp32", "train.steps": steps, "train.seq_len": SEQ_LEN, "train.save_every": 100,
            "train.eval_every": 0, "train.eval_fraction": 0, "train.log_every": 1, "scheduler.type": "none",
            "optimizer.type": "sgd", "optimizer.lr": LR, "optimizer.weight_decay": 0, "gradient_clipping": 0,
            "batch.micro_batch_per_gpu": 2, "batch.grad_accum_steps": 2, "batch.train_batch_size": '"auto"',
            "train.model": root / "student", "train.dataset": root / "data.jsonl", "train.objective": "gkd",
            "train.store_dir": root / "stores", "distill.lmbda": 0, "distill.beta": beta,
            "distill.loss_temperature": temperature, "distill.teacher_model_name_or_path": root / "teacher",
            "distill.teacher_mode": mode, "distill.loss_top_k": k, "distill.loss_chunk_tokens": 7,
            "distill.teacher_timeout_s": timeout_s, "distill.teacher_retries": retries}
    if mode == "served":
        sets["distill.teacher_model_server_url"] = url
    args = ["--recipe", recipe, "--output-dir", str(root / name)]
    for key, value in sets.items():
        args += ["--set", f"{key}={value}"]
    return args


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill_topk")
    llama_folder(root / "student", layers=1)
    sharpen(llama_folder(root / "teacher", seed=77, layers=2))
    write_records(root / "data.jsonl")
    return root


@pytest.fixture(scope="module")
def launched(root):
    server = serve(str(root / "teacher"))
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        started = time.perf_counter()
        proc = launch_jobs([argv(root, name, url, steps=1 if name.endswith("again") else STEPS) for name in CASES],
                           root, ranks=2, timeout_s=900)
        return proc, time.perf_counter() - started
    finally:
        server.shutdown()


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
def test_precomputed_and_served_equal_the_top_k_formula_through_the_step(root, launched):
    proc, seconds = launched
    print(f"one 2-rank launch of {len(CASES)} cases: {seconds:.0f} s")
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
    out = proc.stdout
    assert "(written in" in job_output(out, 0) and "teacher engine of" in job_output(out, 0)
    assert "(read, no teacher built)" in job_output(out, 2)
    assert "served by http://127.0.0.1:" in job_output(out, 3) and "top-4 prompt log-probs" in job_output(out, 3)
    first = records(root / "precomputed_zero3_k4", "train")
    assert records(root / "precomputed_zero3_k4_again", "train")[0]["loss"] == first[0]["loss"]


@pytest.mark.multirank
def test_a_server_that_dies_mid_run_ends_it_with_exit_2_and_the_reason(root):
    port = free_port()
    server = start_server(root / "teacher", port, "--stop-after", "1")
    try:
        started = time.monotonic()
        proc = launch(*argv(root, "served_dies", f"http://127.0.0.1:{port}", timeout_s=5, retries=1), check=False,
                      timeout_s=600)
        took = time.monotonic() - started
    finally:
        server.kill()
        server.wait()
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    assert "error: rank " in proc.stderr and "the served teacher gave no prompt log-probs after 2 attempt(s)" in \
        proc.stderr and f"127.0.0.1:{port}/v1/completions" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not records(root / "served_dies", "train")  # the step the server died in is not logged as trained
    print(f"the run ended {took:.0f} s after its launch")


@pytest.mark.parametrize("block,message", [
    ({"teacher_mode": "precomputed", "lmbda": 0.5}, "teacher_mode precomputed with on-policy"),
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
