"""Real DeepSpeed ranks on CPU: loss parity with plain PyTorch, exact resume, export round-trip.

Each launch costs ~30 s of process start-up, so the runs share ONE launch (tests/drivers/jobs.py), and each
run checks several things: a 6-step run with a checkpoint at step 3 gives the parity trajectory, and resuming
from that checkpoint must reproduce steps 4-6 exactly. The NVMe run launches on its own, with
test_profiling's NVMe run (conftest's nvme_runs).
"""

from __future__ import annotations

import pytest
import torch

from harness.data.corpus import DataSpec
from helpers.baseline import plain_pytorch_losses
from helpers.chat_templates import TEMPLATES, write_tool_chat
from helpers.corpora import chat_model_dir, write_instruction
from helpers.export_checks import assert_export_equals_engine
from helpers.launch import job_output, launch_jobs, losses, records
from helpers.parity import (BETAS, CLIP, COMMON, EPS, EVAL_FRACTION, LR, MICRO, SEED, SEQ_LEN, STEPS, WD, assert_close,
                            assert_planner_matches_engine)

pytestmark = pytest.mark.multirank

FP32_RTOL = 1e-4  # issue bound; measured differences are ~1e-7
BF16_RTOL = 2e-2  # bf16 weights/activations vs an fp32 reference: documented tolerance


def reference_losses(model: str = "tiny-llama", **data) -> list[float]:
    return plain_pytorch_losses(model=model, steps=STEPS, seq_len=SEQ_LEN, global_batch=MICRO * 2, lr=LR,
                                betas=BETAS, eps=EPS, weight_decay=WD, clip=CLIP, seed=SEED,
                                eval_fraction=EVAL_FRACTION, **data)


@pytest.fixture(scope="module")
def reference() -> list[float]:
    return reference_losses()


RECIPES = ["ddp", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload"]
RESUMED = ("ddp", "zero1", "zero2", "zero3")  # resume is covered per ZeRO stage; offload adds no resume state


def data_cases(root) -> dict[str, list[str]]:
    """The instruction run on a store prepared beforehand (`harness data prepare`) and the chat run on a model
    folder whose tokenizer has a chat template (the launch prepares its store itself)."""
    from harness.cli import main

    path, stores = write_instruction(root / "instr.jsonl", 400), root / "instr_stores"
    assert main(["data", "prepare", "--dataset", str(path), "--model", "tiny-llama", "--seq-len", str(SEQ_LEN),
                 "--format", "instruction", "--out", str(stores)]) == 0
    qwen3 = (TEMPLATES / "qwen3.jinja").read_text()  # its markup as plain text: the shipped 512-id tokenizer
    model, chat = chat_model_dir(root / "chat_model", SEED, qwen3), write_tool_chat(root / "chat.jsonl", 400)
    fp32 = ["--recipe", "zero2", "--set", "precision=fp32"]
    return {"instruction": [*fp32, "--output-dir", str(root / "instruction"), *COMMON, "--set", f"train.dataset={path}",
                            "--set", "train.format=instruction", "--set", f"train.store_dir={stores}"],
            "chat": [*fp32, "--output-dir", str(root / "chat"), *COMMON, "--set", f"train.model={model}",
                     "--set", f"train.dataset={chat}", "--set", "train.format=chat",
                     "--set", f"train.store_dir={root / 'chat_stores'}"]}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Every fp32 recipe (+ its resume from step 3), ZeRO-2 offload with accumulation, bf16 with eval, a ZeRO-3
    run to export, the instruction and chat runs: one 2-rank launch. The root (run folders by name) and the
    data runs' (stdout, stderr)."""
    root = tmp_path_factory.mktemp("training")
    cases = []
    for recipe in RECIPES:
        straight = root / recipe / "straight"
        cases.append(["--recipe", recipe, "--set", "precision=fp32", "--output-dir", str(straight), *COMMON])
        if recipe in RESUMED:
            cases.append(["--recipe", recipe, "--set", "precision=fp32", "--output-dir", str(root / recipe / "resumed"),
                          "--resume", str(straight / "checkpoints" / "global_step3"), *COMMON])
    cases.append(["--recipe", "zero2_offload", "--set", "precision=fp32", "--output-dir", str(root / "accum"),
                  *COMMON, "--set", f"batch.micro_batch_per_gpu={MICRO // 2}", "--set", "batch.grad_accum_steps=2"])
    cases.append(["--recipe", "zero2", "--output-dir", str(root / "bf16"), *COMMON, "--set", "train.eval_every=3"])
    cases.append(["--recipe", "zero3", "--set", "precision=fp32", "--output-dir", str(root / "z3"), *COMMON])
    data = data_cases(root)
    proc = launch_jobs(cases + list(data.values()), root)
    return root, {name: (job_output(proc.stdout, i), job_output(proc.stderr, i))
                  for i, name in enumerate(data, start=len(cases))}


@pytest.fixture(scope="module")
def runs(launched):
    return launched[0]


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp32_parity_and_exact_resume(recipe, reference, runs, tmp_path):
    straight = runs / recipe / "straight"
    worst = assert_close(losses(straight), reference, FP32_RTOL)
    print(f"{recipe}: max relative loss difference vs plain PyTorch {worst:.2e}")
    print(f"{recipe}: measured / planner", assert_planner_matches_engine(straight))
    assert (straight / "checkpoints" / "global_step3" / "manifest.json").is_file()
    if recipe in ("ddp", "zero1", "zero2"):  # ZeRO-3 export: test_export_round_trip and tests/test_export.py
        info = assert_export_equals_engine(straight, tmp_path / "hf")
        print(f"{recipe}: export in {info['shards']} shards equals the engine's weights")
    if recipe not in RESUMED:
        return  # resume is covered per ZeRO stage; offload adds no resume state of its own
    after = losses(runs / recipe / "resumed")
    assert sorted(after) == [4, 5, 6]
    for step in (4, 5, 6):
        assert after[step] == losses(straight)[step], f"step {step}: resumed {after[step]} != straight"


def test_zero2_offload_grad_accumulation(reference, runs):
    """2 micro-batches of 2 per rank instead of 1 of 4: the same 8 rows per step, so the same losses; with
    accumulation, ZeRO-2 offload keeps whole-tensor 16-bit gradient buffers on the CPU between steps."""
    run = runs / "accum"
    assert_close(losses(run), reference, FP32_RTOL)
    print("zero2_offload accum 2: measured / planner", assert_planner_matches_engine(run))


@pytest.mark.nvme
def test_zero3_nvme_matches_offload_and_reference(reference, nvme_runs):
    """The fp32 parity run on zero3_nvme (tests/helpers/nvme.py; its launch is shared with test_profiling's NVMe run)."""
    nvme, run = nvme_runs / "parity_nvme", nvme_runs / "parity"
    assert_close(losses(run), reference, FP32_RTOL)
    assert any(nvme.rglob("*")), "no swap files under nvme_path"
    print("zero3_nvme: measured / planner", assert_planner_matches_engine(run))


def test_bf16_within_documented_tolerance_and_eval(reference, runs):
    run = runs / "bf16"
    assert_close(losses(run), reference, BF16_RTOL)
    evals = records(run, "eval")
    assert [r["step"] for r in evals] == [3, 6] and all(r["eval_loss"] < 7 for r in evals)


def test_export_round_trip(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    from harness.checkpoint.export.folder import export

    run = runs / "z3"
    info = export(run, tmp_path / "hf")
    assert info["zero_stage"] == 3 and info["step"] == STEPS
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    probe = torch.load(run / "checkpoints" / f"global_step{STEPS}" / "probe.pt", weights_only=True)
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"]).logits
    assert logits.shape == probe["logits"].shape
    torch.testing.assert_close(logits, probe["logits"], rtol=1e-5, atol=1e-5)


def test_instruction_parity_on_a_store_prepared_beforehand(launched):
    """`harness data prepare` first, then the launch only memory-maps the store: no tokenization in the launch.
    Loss only on response tokens; the reference averages the two ranks' micro-batch means as DeepSpeed does."""
    root, (stdout, stderr) = launched[0], launched[1]["instruction"]
    path, stores, run = root / "instr.jsonl", root / "instr_stores", root / "instruction"
    assert "using store" in stdout and "tokenize" not in stderr
    want = reference_losses(data=DataSpec(str(path), format="instruction"), store_dir=str(stores), micro_batches=2)
    print(f"instruction: max relative loss difference vs one process {assert_close(losses(run), want, FP32_RTOL):.2e}")


def test_chat_parity_with_a_chat_template_model_folder(launched):
    """A model folder whose tokenizer has Qwen3's chat template, records with tool calls and reasoning: the
    two-question records (half) train in two samples each, as the template rewrites their first turn's history, and
    the start-up lines say so; the launch prepares the store itself."""
    root, (stdout, _) = launched[0], launched[1]["chat"]
    model, path, run, stores = root / "chat_model", root / "chat.jsonl", root / "chat", root / "chat_stores"
    assert "prepared store" in stdout and "600 documents" in stdout
    assert "the chat template renders 50 of the first 100 records differently" in stdout
    want = reference_losses(str(model), data=DataSpec(str(path), format="chat"), store_dir=str(stores),
                            micro_batches=2)
    print(f"chat: max relative loss difference vs one process {assert_close(losses(run), want, FP32_RTOL):.2e}")
