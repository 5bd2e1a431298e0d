"""The `tp` recipe on 2 real DeepSpeed ranks (tensor 2 x data 1, the harness's own tensor-parallel layers):
fp32 loss parity with ONE plain PyTorch process on the same global batch, for tiny-llama and for a Qwen2-shaped
local model folder (GQA 4 heads / 2 kv heads, q/k/v biases, tied embeddings) saved with save_pretrained, on
ZeRO-3; the start-up line shows the whole model's size; save -> resume continues exactly; `harness export`
merges the tensor-parallel shards into one HF folder whose logits equal the engine's; profiled steps 3-4: each
rank's logged collectives (tensor-parallel all-reduces + the gradient reduction over a data-parallel group of
one) equal the run's own planner prediction. The three runs (tiny-llama, Qwen2, the resume) share ONE launch.
"""

from __future__ import annotations

import json

import pytest
import torch

from helpers.baseline import plain_pytorch_losses
from helpers.launch import job_output, launch_jobs, losses
from helpers.models import qwen2_folder

pytestmark = pytest.mark.multirank

STEPS, SEQ_LEN, MICRO, SEED, LR = 6, 64, 4, 1234, 1e-3
BETAS, EPS, WD, CLIP, EVAL_FRACTION = (0.9, 0.999), 1e-8, 0.01, 1.0, 0.02
FP32_RTOL = 1e-5  # issue bound; measured ~1e-7
COMMON = ["--recipe", "tp", "--set", "precision=fp32", "--set", f"train.steps={STEPS}",
          "--set", f"train.seq_len={SEQ_LEN}", "--set", "train.save_every=3", "--set", "train.eval_every=0",
          "--set", "scheduler.type=none", "--set", f"optimizer.lr={LR}", "--set", f"optimizer.betas={list(BETAS)}",
          "--set", f"optimizer.eps={EPS}", "--set", f"optimizer.weight_decay={WD}",
          "--set", f"gradient_clipping={CLIP}", "--set", f"batch.micro_batch_per_gpu={MICRO}",
          "--set", "batch.grad_accum_steps=1", "--set", "batch.train_batch_size=\"auto\"",
          "--set", f"train.eval_fraction={EVAL_FRACTION}"]


def _full_params(model: str) -> int:
    from harness.model.hf import build_model

    return sum(p.numel() for p in build_model(model, seed=SEED).parameters())


def _reference(model: str) -> list[float]:
    return plain_pytorch_losses(model=model, steps=STEPS, seq_len=SEQ_LEN, global_batch=MICRO, lr=LR, betas=BETAS,
                                eps=EPS, weight_decay=WD, clip=CLIP, seed=SEED, eval_fraction=EVAL_FRACTION)


def _worst(got: dict[int, float], want: list[float]) -> float:
    assert sorted(got) == list(range(1, STEPS + 1)), f"steps logged: {sorted(got)}"
    return max(abs(got[i + 1] - w) / abs(w) for i, w in enumerate(want))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """A 2-rank tp run per model (6 steps, checkpoints at 3 and 6), then tiny-llama's resume from step 3 (its
    folder under "resumed"): one launch."""
    base = tmp_path_factory.mktemp("tp")
    # The Qwen2 run uses ZeRO-3 (the recipe's ZeRO-1 otherwise): shards partitioned over the data-parallel
    # group, exported through zero_to_fp32 one tensor rank at a time.
    models = (("tiny-llama", "tiny-llama", 1), ("qwen2", qwen2_folder(base / "qwen2-model"), 3))
    cases = [[*COMMON, "--set", f"train.model={model}", "--set", f"zero.stage={stage}", "--profile-steps", "3-4",
              "--output-dir", str(base / name)] for name, model, stage in models]
    cases.append([*COMMON, "--output-dir", str(base / "resumed"),
                  "--resume", str(base / "tiny-llama" / "checkpoints" / "global_step3")])
    proc = launch_jobs(cases, base)
    out = {name: {"model": model, "run": base / name, "stdout": job_output(proc.stdout, i)}
           for i, (name, model, _) in enumerate(models)}
    return {**out, "resumed": base / "resumed"}


@pytest.mark.parametrize("name", ["tiny-llama", "qwen2"])
def test_tp_matches_one_process_and_exports(name, runs, tmp_path):
    from transformers import AutoModelForCausalLM

    from harness.checkpoint.export.folder import export

    r = runs[name]
    worst = _worst(losses(r["run"]), _reference(r["model"]))
    print(f"tp {name}: max relative loss difference vs one process {worst:.2e}")
    assert worst <= FP32_RTOL, f"{name}: {worst:.3g} > {FP32_RTOL}"
    assert f": {_full_params(r['model']) / 1e6:.2f}M params" in r["stdout"], "start-up line: the whole model"
    comm = json.loads((r["run"] / "summary.json").read_text())["comm"]
    for rank, (measured, predicted) in enumerate(zip(comm["measured_per_rank"], comm["predicted_per_rank"])):
        assert "all_reduce" in predicted, predicted
        for op, want in predicted.items():
            assert abs(measured.get(op, 0) / want - 1) <= 0.05, f"rank {rank} {op}: {measured.get(op)} vs {want}"
        assert all(b < 64 for op, b in measured.items() if op not in predicted), measured  # norm scalars only
    manifest = json.loads((r["run"] / "checkpoints" / "global_step3" / "manifest.json").read_text())
    assert (manifest["tp"], manifest["dp"], manifest["world_size"]) == (2, 1, 2)
    info = export(r["run"], tmp_path / "hf")
    assert (info["tp"], info["step"]) == (2, STEPS) and info["max_logit_diff"] <= 1e-5
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    probe = torch.load(r["run"] / "checkpoints" / f"global_step{STEPS}" / "probe.pt", weights_only=True)
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"]).logits
    torch.testing.assert_close(logits, probe["logits"], rtol=1e-5, atol=1e-5)


def test_tp_resume_is_exact(runs):
    straight = runs["tiny-llama"]["run"]
    resumed = runs["resumed"]
    after = losses(resumed)
    assert sorted(after) == [4, 5, 6]
    for step in (4, 5, 6):
        assert after[step] == losses(straight)[step], f"step {step}: resumed {after[step]} != straight"

