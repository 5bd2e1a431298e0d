"""Ulysses sequence parallelism (harness/model/sequence/): refusals before any rank trains, and, on 2 CPU ranks in
ONE process group (tests/drivers/sequence_parallel.py), sp=2 against sp=1 on every ZeRO stage with SGD at lr 1 and no clipping
(the update is the gradient), the tiled loss against the plain one, and document masking under SP."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.dist import Launch
from harness.errors import ConfigError
from harness.train import run_args, session
from helpers.launch import ROOT, env, launch, launch_jobs, losses, records

STAGES = ("zero0", "zero1", "zero2", "zero3", "zero3_offload")


def prepare(world: int, *sets: str, model: str = "tiny-llama"):
    argv = ["--recipe", "zero2", "--model", model, "--set", "train.seq_len=64"]
    for s in sets:
        argv += ["--set", s]
    return session.prepare(run_args.parse(argv), Launch(world_size=world, local_size=world))


def refused(world: int, *sets: str, model: str = "tiny-llama") -> str:
    with pytest.raises(ConfigError) as err:
        prepare(world, *sets, model=model)
    return str(err.value)


def _qwen2_folder(path: Path, sliding: bool = False, heads: int = 4, kv: int = 2) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from harness.model.hf import _shipped_eos_id, load_tokenizer

    eos = _shipped_eos_id()
    config = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=eos, eos_token_id=eos, attention_dropout=0.0,
                         use_sliding_window=sliding, sliding_window=16 if sliding else None, max_window_layers=0)
    Qwen2ForCausalLM(config).save_pretrained(path)
    load_tokenizer("tiny-llama").save_pretrained(path)
    return str(path)


def test_sp_spec_counts_dp_over_world_over_sp():
    spec = prepare(4, "parallel.sequence=2")
    assert (spec.sp, spec.dp) == (2, 2)
    assert spec.ds_config["sequence_parallel_size"] == 2
    # DeepSpeed's batch assertion counts world / sp data-parallel ranks: 4 micro x 1 accum x 2
    assert spec.ds_config["train_batch_size"] == spec.ds_config["train_micro_batch_size_per_gpu"] * 2


@pytest.mark.parametrize("world,sets,fragment", [
    (3, ["parallel.sequence=2"], "does not divide the world size 3 (3 % 2 = 1)"),
    (2, ["parallel.sequence=2", "train.seq_len=63"], "seq_len 63 does not split over sequence-parallel degree 2"),
    (8, ["parallel.sequence=8"], "4 attention heads do not split over sequence-parallel degree 8 (4 % 8 = 4)"),
    (4, ["parallel.sequence=2", "parallel.tensor=2"], "with pipeline 1 / tensor 2 is not supported"),
    (4, ["parallel.sequence=2", "parallel.pipeline=2", "zero.stage=1"], "with pipeline 2 / tensor 1 is not supported"),
    (2, ["parallel.sequence=2", "train.attention=eager"], "eager attention under sequence parallelism"),
    (2, ["train.attention=flash_attention_2"], "train.attention: flash_attention_2 needs a CUDA GPU"),
    (2, ["parallel.sequence=2", "train.attention=sdpa"], "sdpa under sequence parallelism (2) loses the document"),
    (2, ["parallel.sequence=2", "train.attention=flex_attention"], "flex_attention under sequence parallelism (2)"),
    (2, ["train.activation_offload=true"], "would be a silent no-op"),
])
def test_refusals(world, sets, fragment):
    assert fragment in refused(world, *sets)


def test_kv_heads_and_sliding_window_refused(tmp_path):
    odd_kv = _qwen2_folder(tmp_path / "kv3", heads=6, kv=3)
    text = refused(2, "parallel.sequence=2", model=odd_kv)
    assert "3 kv heads and sequence-parallel degree 2: neither divides the other" in text
    windowed = _qwen2_folder(tmp_path / "window", sliding=True)
    assert "sliding_attention layers" in refused(2, "parallel.sequence=2", model=windowed)
    prepare(2, "parallel.sequence=2", model=_qwen2_folder(tmp_path / "ok"))  # full attention: fine


def test_refusal_exits_2_before_any_rank(tmp_path):
    """The real entry point: exit 2, the arithmetic and the fix, no traceback, no process group."""
    proc = subprocess.run([sys.executable, "harness/run.py", "--recipe", "zero2", "--set", "parallel.sequence=2",
                           "--set", "train.seq_len=63", "--output-dir", str(tmp_path / "run")], cwd=ROOT,
                          env={**env(), "WORLD_SIZE": "2", "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "63 % 2 = 1" in proc.stderr and "fix: --set train.seq_len=62" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    out = tmp_path_factory.mktemp("sp") / "out.json"
    qwen2 = _qwen2_folder(tmp_path_factory.mktemp("qwen2") / "model")
    launch(str(out), "tiny-llama", qwen2, script="tests/drivers/sequence_parallel.py", timeout_s=600)
    return json.loads(out.read_text())


def _rel(a: list[float], b: list[float]) -> float:
    diff = math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b)))
    return diff / math.sqrt(sum(y * y for y in b))


@pytest.mark.multirank
@pytest.mark.parametrize("stage", STAGES)
def test_sp2_update_equals_sp1(parity, stage):
    ref, got = parity[f"sp1/{'zero3' if stage.startswith('zero3') else 'zero0'}"], parity[f"sp2/{stage}"]
    assert len(got["update"]) == len(ref["update"])
    assert abs(got["loss"] - ref["loss"]) < 1e-6
    assert _rel(got["update"], ref["update"]) < 1e-5  # an sp-times update (trap 2) would be off by 1.0
    norm = lambda u: math.sqrt(sum(x * x for x in u))  # noqa: E731  lr 1, SGD: the update is the gradient
    assert abs(norm(got["update"]) - norm(ref["update"])) < 1e-6 * norm(ref["update"])
    if got["norm"] is not None and ref["norm"] is not None:  # the engine's own norm (None on ZeRO-0 with SGD)
        assert abs(got["norm"] - ref["norm"]) < 1e-5 * ref["norm"]


@pytest.mark.multirank
def test_harness_runs_lora_at_sp2_like_sp1_and_resumes_exactly(tmp_path):
    """The real entry (session.prepare -> job.run) in ONE process group (tests/drivers/jobs.py): LoRA on ZeRO-3 at
    sp=1 (dp 2, micro 1) and sp=2 (dp 1, micro 2: the same 2 sequences per step) log the same losses; the sp=2 run
    resumed from its step-2 checkpoint logs steps 3-4 exactly as the uninterrupted run did; its export equals sp=1's."""
    sets = ["precision=fp32", "train.seq_len=64", "train.steps=4", "train.log_every=1", "train.eval_every=4",
            "train.save_every=2", "batch.train_batch_size=2", "batch.grad_accum_steps=1"]
    common = ["--recipe", "lora_zero3", *(a for s in sets for a in ("--set", s))]
    sp2_args = ["--set", "batch.micro_batch_per_gpu=2", "--set", "parallel.sequence=2"]
    sp1, sp2 = tmp_path / "sp1", tmp_path / "sp2"
    cases = [[*common, "--set", "batch.micro_batch_per_gpu=1", "--output-dir", str(sp1)],
             [*common, *sp2_args, "--output-dir", str(sp2)],
             [*common, *sp2_args, "--output-dir", str(tmp_path / "resumed"),
              "--resume", str(sp2 / "checkpoints" / "global_step2")]]
    launch_jobs(cases, tmp_path, timeout_s=600)
    first, resumed = losses(sp2), losses(tmp_path / "resumed")
    assert sorted(resumed) == [3, 4]
    for step, loss in losses(sp1).items():
        assert abs(first[step] - loss) < 1e-5, (step, first[step], loss)
    for step in (3, 4):
        assert resumed[step] == pytest.approx(first[step], abs=1e-6)
    assert first[4] != first[1]  # it trained
    evals = records(sp2, "eval")
    assert abs(evals[0]["eval_loss"] - records(sp1, "eval")[0]["eval_loss"]) < 1e-5  # eval sharded like training
    _export_matches_sp1(sp1, sp2, tmp_path)


def _export_matches_sp1(sp1: Path, sp2: Path, tmp_path: Path) -> None:
    """`harness export` of the sp=2 run (LoRA merged): the checkpoint carries a probe the SP ranks computed
    together, which export checks against the written folder; the folder loads in AutoModelForCausalLM and gives
    the sp=1 run's exported logits."""
    import torch
    from transformers import AutoModelForCausalLM

    from harness.checkpoint.export.folder import export

    assert (sp2 / "checkpoints" / "global_step4" / "probe.pt").is_file()
    got = {name: export(run / "checkpoints" / "global_step4", tmp_path / f"export_{name}")
           for name, run in (("sp1", sp1), ("sp2", sp2))}
    assert got["sp2"]["max_logit_diff"] is not None and got["sp2"]["max_logit_diff"] <= got["sp2"]["tolerance"]
    probe = torch.load(sp2 / "checkpoints" / "global_step4" / "probe.pt", weights_only=True)
    assert probe["input_ids"].shape == (1, 16)
    with torch.no_grad():
        logits = {name: AutoModelForCausalLM.from_pretrained(info["out"]).eval()(input_ids=probe["input_ids"]).logits
                  for name, info in got.items()}
    assert torch.allclose(logits["sp2"], probe["logits"], atol=1e-5)  # the sp=2 engine's own logits
    assert torch.allclose(logits["sp2"], logits["sp1"], atol=1e-5)


@pytest.mark.multirank
def test_tiled_loss_and_mlp_with_rescaled_loss_keep_the_gradient(parity):
    """ZeRO-3, sp=2, tiled head (4 tiles of 8 tokens) and tiled MLP (2 tiles per row), the loss divided by 7 after
    the tiled head and by 2 by the accumulation: 7 x the update equals the sp=1 update."""
    ref, got = parity["sp1/zero3"], parity["sp2/zero3_tiled"]
    assert "error" not in got, got.get("error")
    assert got["tiled_mlps"] == 2
    assert abs(got["loss"] - ref["loss"]) < 1e-5
    assert _rel(got["update"], ref["update"]) < 1e-5


@pytest.mark.multirank
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_document_masking_under_sp(parity, family):
    """Every document's per-token losses in a packed row at sp=2 equal the document run alone at sp=1."""
    key = next(k for k in parity if k.startswith("documents/") and (family == "qwen2") == ("qwen2" in k))
    case = parity[key]
    assert "error" not in case, case.get("error")
    for row, lengths in enumerate(case["docs"]):
        start = 0
        for length in lengths:
            span = slice(start, start + length)
            packed, alone = case["packed"][row][span], case["alone"][row][span]
            assert packed[-1] == 0.0  # the last token predicts the next document's first label: -100
            assert max(abs(a - b) for a, b in zip(packed, alone)) < 1e-5, (row, start)
            if start > 0:  # the control: attention across documents changes these losses
                assert max(abs(a - b) for a, b in zip(case["leaky"][row][span][:-1], alone[:-1])) > 1e-3
            start += length


def test_tiled_head_gradients_survive_a_rescale_and_accumulation():
    """No ranks: two accumulated micro-batches of the tiled head (3-token tiles), each loss divided by 7 after it,
    give the gradients of the plain lm_head + cross-entropy (trap 3: TiledFusedLogitsLoss gets lm_head's wrong)."""
    import torch

    from harness.model.sequence.loss import TiledHeadLoss

    torch.manual_seed(0)
    hidden = [torch.randn(2, 10, 8, requires_grad=True) for _ in range(2)]
    weight = torch.randn(30, 8, requires_grad=True)
    labels = [torch.randint(0, 30, (2, 10)) for _ in range(2)]
    labels[0][0, :4] = -100
    for h, y in zip(hidden, labels):
        (torch.nn.functional.cross_entropy((h @ weight.t()).reshape(-1, 30), y.reshape(-1), ignore_index=-100,
                                           reduction="sum") / 7).backward()
    expected = [h.grad.clone() for h in hidden] + [weight.grad.clone()]
    for t in (*hidden, weight):
        t.grad = None
    for h, y in zip(hidden, labels):
        (TiledHeadLoss.apply(h, weight, y, 3) / 7).backward()
    for got, want in zip([h.grad for h in hidden] + [weight.grad], expected):
        assert torch.allclose(got, want, atol=1e-6), (got - want).abs().max()
    with torch.no_grad():  # eval: the loss alone
        assert TiledHeadLoss.apply(hidden[0], weight, labels[0], 3).requires_grad is False


def test_document_sdpa_at_sp1_keeps_documents_apart():
    """No ranks: a packed row through document_sdpa gives each document's per-token losses run alone."""
    import torch

    from harness.model.hf import build_model
    from harness.model.sequence import attention, ulysses

    model = build_model("tiny-llama", seed=3).eval()
    reference = build_model("tiny-llama", seed=3).eval()
    attention.apply(model, attention.DOCUMENT)
    ids = torch.randint(3, 500, (1, 24), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(9), torch.arange(15)])[None]
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        for span in (slice(0, 9), slice(9, 24)):
            alone = reference(input_ids=ids[:, span], use_cache=False).logits
            assert torch.allclose(packed[:, span], alone, atol=1e-5)
        leaky = reference(input_ids=ids, use_cache=False).logits[:, 9:]
        assert not torch.allclose(packed[:, 9:], leaky, atol=1e-3)  # the control
    assert ulysses.shift_labels(ids)[0, -1] == -100
