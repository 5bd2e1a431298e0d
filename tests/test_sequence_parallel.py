"""Ulysses sequence parallelism (harness/model/sequence/): refusals before any rank trains, and, on 2 CPU ranks in
ONE process group (tests/sp_driver.py), sp=2 against sp=1 on every ZeRO stage with SGD at lr 1 and no clipping
(the update is the gradient), the tiled loss against the plain one, and document masking under SP."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.errors import ConfigError
from harness.train import run_args, session
from tests.launch import ROOT, env, launch

STAGES = ("zero0", "zero1", "zero2", "zero3", "zero3_offload")


def prepare(monkeypatch, world: int, *sets: str, model: str = "tiny-llama"):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    argv = ["--recipe", "zero2", "--model", model, "--set", "train.seq_len=64"]
    for s in sets:
        argv += ["--set", s]
    return session.prepare(run_args.parse(argv))


def refused(monkeypatch, world: int, *sets: str, model: str = "tiny-llama") -> str:
    with pytest.raises(ConfigError) as err:
        prepare(monkeypatch, world, *sets, model=model)
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


def test_sp_spec_counts_dp_over_world_over_sp(monkeypatch):
    spec = prepare(monkeypatch, 4, "parallel.sequence=2")
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
    (2, ["train.attention=flash_attention_2"], "flash_attention_2 runs on CUDA GPUs only"),
    (2, ["train.activation_offload=true"], "would be a silent no-op"),
])
def test_refusals(monkeypatch, world, sets, fragment):
    assert fragment in refused(monkeypatch, world, *sets)


def test_kv_heads_and_sliding_window_refused(monkeypatch, tmp_path):
    odd_kv = _qwen2_folder(tmp_path / "kv3", heads=6, kv=3)
    text = refused(monkeypatch, 2, "parallel.sequence=2", model=odd_kv)
    assert "3 kv heads and sequence-parallel degree 2: neither divides the other" in text
    windowed = _qwen2_folder(tmp_path / "window", sliding=True)
    assert "sliding_attention layers" in refused(monkeypatch, 2, "parallel.sequence=2", model=windowed)
    prepare(monkeypatch, 2, "parallel.sequence=2", model=_qwen2_folder(tmp_path / "ok"))  # full attention: fine


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
    launch(str(out), "tiny-llama", script="tests/sp_driver.py", timeout_s=600)
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
