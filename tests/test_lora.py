"""LoRA on every strategy, on real DeepSpeed ranks: fp32 loss parity with ONE process training the same
peft-wrapped model with torch AdamW on the same global batch of 8 sequences (tests/helpers/baseline.py), exact
resume, planner bytes vs the live engine, and both exports checked against the engine's logits.

Two launches: one 2-rank process group runs nine jobs in a row (tests/drivers/jobs.py): zero2, zero2 with LoRA+,
zero2 with DoRA and lm_head in modules_to_save, zero3 (+ its resume from step 3), zero3 with the optimizer on
CPU and activation checkpointing (frozen inputs, non-reentrant), pipeline 2 (+ resume), tp 2 on a Qwen2-shaped
folder; and one 8-rank 3D job (pipeline 2 x tensor 2 x data 2). One single-process resume of the 2-rank ZeRO-3
checkpoint (another world size).
"""

from __future__ import annotations

import pytest
import torch

from helpers.baseline import plain_pytorch_losses
from helpers.launch import launch, launch_jobs, losses
from helpers.models import qwen2_folder
from helpers.parity import COMMON, assert_close, assert_planner_matches_engine

pytestmark = pytest.mark.multirank

STEPS, SEQ_LEN, SEED, LR = 6, 64, 1234, 1e-3
FP32_RTOL = 1e-5  # issue bound
LORA = ["--set", "precision=fp32", "--set", "adapter.type=lora", *COMMON]
LORA_PLUS = 4
DORA = ["--set", "adapter.use_dora=true", "--set", 'adapter.modules_to_save=["lm_head"]']
ACCUM2 = ["--set", "batch.grad_accum_steps=2"]  # pipeline and tp: 4 micro x 2 accum x 1 replica = 8 sequences


def adapter_block() -> dict:
    from harness.config.recipes import load_recipe

    return load_recipe("lora_zero2")[0]["adapter"]


def reference(model: str = "tiny-llama", **adapter) -> list[float]:
    return plain_pytorch_losses(model=model, steps=STEPS, seq_len=SEQ_LEN, global_batch=8, lr=LR, betas=(0.9, 0.999),
                                eps=1e-8, weight_decay=0.01, clip=1.0, seed=SEED, eval_fraction=0.02,
                                adapter={**adapter_block(), **adapter})


def _cases(root, qwen: str) -> list[list[str]]:
    step3 = lambda name: str(root / name / "checkpoints" / "global_step3")  # noqa: E731
    return [
        ["--recipe", "lora_zero2", "--output-dir", str(root / "zero2"), *LORA],
        ["--recipe", "lora_zero2", "--output-dir", str(root / "zero2_lora_plus"), *LORA,
         "--set", f"adapter.lr_B_ratio={LORA_PLUS}"],
        ["--recipe", "lora_zero2", "--output-dir", str(root / "zero2_dora"), *LORA, *DORA],
        ["--recipe", "lora_zero3", "--output-dir", str(root / "zero3"), *LORA],
        ["--recipe", "lora_zero3", "--output-dir", str(root / "zero3_resumed"), "--resume", step3("zero3"), *LORA],
        ["--recipe", "lora_zero3", "--output-dir", str(root / "zero3_offload"), *LORA,
         "--set", "zero.offload_optimizer=cpu", "--set", "activation_checkpointing=true"],  # frozen inputs
        ["--recipe", "pipeline", "--output-dir", str(root / "pipeline"), *LORA, *ACCUM2],
        ["--recipe", "pipeline", "--output-dir", str(root / "pipeline_resumed"), "--resume", step3("pipeline"),
         *LORA, *ACCUM2],
        ["--recipe", "tp", "--output-dir", str(root / "tp_qwen2"), *LORA, *ACCUM2, "--set", f"train.model={qwen}"],
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    qwen = qwen2_folder(root / "qwen2")
    launch_jobs(_cases(root, qwen), root)
    return root, qwen


@pytest.fixture(scope="module")
def llama_reference() -> list[float]:
    return reference()


@pytest.mark.parametrize("name", ["zero2", "zero3", "zero3_offload", "pipeline"])
def test_parity_with_one_peft_process(runs, llama_reference, name):
    worst = assert_close(losses(runs[0] / name), llama_reference, FP32_RTOL)
    print(f"lora {name}: max relative loss difference vs one peft process {worst:.2e}")
    assert losses(runs[0] / name)[STEPS] < losses(runs[0] / name)[1], "the adapters did not learn"


def test_lora_plus_param_groups(runs, llama_reference):
    """adapter.lr_B_ratio: B in its own DeepSpeed param group at lr x 4, as torch AdamW with two groups."""
    got = losses(runs[0] / "zero2_lora_plus")
    worst = assert_close(got, reference(lr_B_ratio=LORA_PLUS), FP32_RTOL)
    assert abs(got[STEPS] - llama_reference[STEPS - 1]) > 1e-5, "the B learning rate changed nothing"
    print(f"lora+ zero2: max relative loss difference {worst:.2e}")


def test_dora_with_a_module_to_save(runs, tmp_path):
    """DoRA magnitudes and a fully trained lm_head beside the adapters: parity, and the adapter folder (their keys
    as peft writes them) loads with plain peft and reproduces the engine."""
    from harness.checkpoint.export.folder import export

    run = runs[0] / "zero2_dora"
    worst = assert_close(losses(run), reference(use_dora=True, modules_to_save=["lm_head"]), FP32_RTOL)
    info = export(run, tmp_path / "adapter", adapter_only=True)
    assert info["tensors"] == 28 + 14 + 1 and info["max_logit_diff"] < 1e-4  # A, B; magnitudes; lm_head
    merged = export(run, tmp_path / "merged")
    assert merged["max_logit_diff"] < 1e-4
    print(f"lora dora + modules_to_save zero2: max relative loss difference {worst:.2e}")


def test_tp_parity_on_a_qwen2_folder(runs):
    root, qwen = runs
    worst = assert_close(losses(root / "tp_qwen2"), reference(qwen), FP32_RTOL)
    print(f"lora tp (Qwen2 folder): max relative loss difference {worst:.2e}")


@pytest.mark.parametrize("name", ["zero3", "pipeline"])
def test_exact_resume(runs, name):
    straight, resumed = losses(runs[0] / name), losses(runs[0] / f"{name}_resumed")
    assert sorted(resumed) == [4, 5, 6]
    assert all(resumed[s] == straight[s] for s in (4, 5, 6)), f"{resumed} vs {straight}"


@pytest.mark.parametrize("name", ["zero2", "zero3", "pipeline"])
def test_planner_bytes_equal_the_live_engine(runs, name):
    print(f"lora {name}: measured / planner", assert_planner_matches_engine(runs[0] / name))


def test_checkpoints_hold_no_frozen_weights(runs):
    """A ZeRO-3 LoRA checkpoint's model and optimizer files together stay far below one fp32 copy of the base."""
    folder = runs[0] / "zero3" / "checkpoints" / "global_step6"
    saved = sum(f.stat().st_size for f in folder.glob("*.pt") if f.name != "probe.pt" and "rng" not in f.name)
    base_fp32 = 4 * sum(p.numel() for p in _base().parameters())
    assert saved < 0.5 * base_fp32, f"checkpoint {saved} B vs the fp32 base {base_fp32} B"


def _base():
    from harness.model.hf import build_model

    return build_model("tiny-llama", seed=SEED).float().eval()


def test_adapter_from_zero3_loads_with_plain_peft_and_merged_equals_base_plus_adapter(runs, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from harness.checkpoint.export.folder import export

    run = runs[0] / "zero3"
    info = export(run, tmp_path / "adapter", adapter_only=True)
    probe = torch.load(run / "checkpoints" / f"global_step{STEPS}" / "probe.pt", weights_only=True)
    tensors = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert info["tensors"] == len(tensors) == 2 * 7 * 2 and all(t.numel() > 0 for t in tensors.values())
    peft_model = PeftModel.from_pretrained(_base(), tmp_path / "adapter").eval()  # plain peft, nothing of ours
    with torch.no_grad():
        logits = peft_model(input_ids=probe["input_ids"]).logits
        base_logits = _base()(input_ids=probe["input_ids"]).logits
    torch.testing.assert_close(logits, probe["logits"], rtol=1e-5, atol=1e-5)
    assert (base_logits - probe["logits"]).abs().max() > 1e-3, "the adapter changed nothing: the check is empty"

    export(run, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    want = peft_model.merge_and_unload().state_dict()
    got = merged.state_dict()
    assert set(got) == set(want)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-6, atol=1e-6, msg=name)


def test_3d_parity_on_8_ranks(llama_reference, tmp_path):
    run = tmp_path / "3d"
    launch("--recipe", "3d", "--output-dir", str(run), *LORA, "--set", "batch.grad_accum_steps=1", ranks=8,
           timeout_s=900)
    worst = assert_close(losses(run), llama_reference, FP32_RTOL)
    print(f"lora 3d (pp 2 x tp 2 x dp 2): max relative loss difference {worst:.2e}")


@pytest.mark.parametrize("name", ["pipeline", "tp_qwen2"])
def test_pipeline_and_tp_adapters_export_and_match_the_engine(runs, name, tmp_path):
    """Per-layer files (pipeline) and tensor-parallel shards (B of q/k/v/gate/up by rows, A of o/down by columns)
    reassemble into the whole adapters; export raises if the logits disagree with the engine's probe."""
    from harness.checkpoint.export.folder import export

    adapter = export(runs[0] / name, tmp_path / "adapter", adapter_only=True)
    merged = export(runs[0] / name, tmp_path / "merged")
    assert adapter["tensors"] == 28 and adapter["max_logit_diff"] < 1e-4 and merged["max_logit_diff"] < 1e-4


def test_resume_on_another_world_size(runs, tmp_path):
    """The 2-rank ZeRO-3 LoRA checkpoint resumed by ONE process (through DeepSpeed's universal form, which then
    holds the adapters only): steps 4-6 continue the 2-rank trajectory."""
    import subprocess
    import sys

    from helpers.launch import ROOT, env

    run = tmp_path / "world1"
    cmd = [sys.executable, str(ROOT / "harness" / "run.py"), "--recipe", "lora_zero3", "--output-dir", str(run),
           "--resume", str(runs[0] / "zero3" / "checkpoints" / "global_step3"), *LORA]
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "universal checkpoint" in proc.stdout
    straight, resumed = losses(runs[0] / "zero3"), losses(run)
    assert sorted(resumed) == [4, 5, 6]
    assert all(abs(resumed[s] - straight[s]) <= 1e-6 * abs(straight[s]) for s in (4, 5, 6)), f"{resumed} vs {straight}"
