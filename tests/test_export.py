"""`harness export` by stream: save_pretrained's shard files and index, exact weights, --dtype, bounded memory.

The memory test needs a model much larger than a shard: one 2-rank ZeRO-3 launch trains an 13M-parameter
Llama folder (54 MB in fp32) for one step; exporting it in 1 MB shards must stay within a few shards of
private memory, where the whole-model export held the model at least once over.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.export_checks import assert_export_equals_engine, read_sharded
from harness.model import hf as models
from helpers.launch import ROOT, env, launch

SHARD = "1MB"


def _save_pretrained_twin(model, folder: Path, max_shard_size: str) -> None:
    """Our writer on a live model's tensors (what export feeds it from the rank files)."""
    from harness.checkpoint.export.folder import save_names
    from harness.checkpoint.export.hf_shards import plan_shards, write_sharded

    state = model.state_dict()
    names = save_names(model)
    split = plan_shards([(n, tuple(state[n].shape), state[n].dtype) for n in names], max_shard_size)
    folder.mkdir()
    write_sharded(folder, split, ((n, state[n]) for n in names), model.num_parameters())


@pytest.mark.parametrize("preset,size", [("tiny-llama", "40KB"), ("tiny-gpt2", "60KB"), ("tiny-llama", "5GB")])
def test_shards_and_index_are_save_pretrained_s(preset, size, tmp_path):
    model = models.build_model(preset, seed=3)
    model.save_pretrained(tmp_path / "hf", max_shard_size=size)
    _save_pretrained_twin(model, tmp_path / "ours", size)
    weights = sorted(p.name for p in (tmp_path / "hf").iterdir() if "safetensors" in p.name)
    assert weights == sorted(p.name for p in (tmp_path / "ours").iterdir())
    assert (len(weights) > 2) == (size != "5GB"), weights  # several shards + index, or one model.safetensors
    for name in weights:
        if name.endswith(".json"):
            assert (tmp_path / "hf" / name).read_text() == (tmp_path / "ours" / name).read_text()
    ours, theirs = dict(read_sharded(tmp_path / "ours")), dict(read_sharded(tmp_path / "hf"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def _folder_model(path: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=384, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=6,
                         num_key_value_heads=2, vocab_size=1024, max_position_embeddings=128,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    models.load_tokenizer("tiny-llama").save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("export")
    run = base / "run"
    launch("--recipe", "zero3", "--set", "precision=fp32", "--set", f"train.model={_folder_model(base / 'model')}",
           "--set", "train.steps=1", "--set", "train.save_every=1", "--set", "train.eval_every=0",
           "--set", "train.seq_len=32", "--set", "batch.micro_batch_per_gpu=1", "--set", "batch.grad_accum_steps=1",
           "--set", "batch.train_batch_size=\"auto\"", "--output-dir", str(run))
    return run


@pytest.mark.multirank
def test_export_memory_is_one_shard_not_the_model(zero3_run, tmp_path):
    """High-water marks of a fresh export process (tests/drivers/export_memory.py): private memory (RssAnon, sampled)
    while writing and while verifying, and VmHWM (private + mapped checkpoint pages) while writing."""
    proc = subprocess.run([sys.executable, "tests/drivers/export_memory.py", str(zero3_run), str(tmp_path / "hf"), SHARD],
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = json.loads(proc.stdout.splitlines()[-1])
    bound = m["largest_shard_bytes"] + m["largest_tensor_bytes"]
    print("export memory:", {k: m[k] for k in ("write", "verify", "total_size_bytes", "shards")}, "bound", bound)
    assert m["shards"] >= 20 and m["total_size_bytes"] > 10 * bound, m  # the old export held >= the model
    assert m["write"]["rss_anon_peak_growth_bytes"] <= 2 * bound + (8 << 20), m  # + config, tokenizer, allocator
    # VmHWM also counts mapped checkpoint pages and ~20-30 MB of page faults around them, whatever the model:
    # below the model's size (the old export's VmHWM grew by over twice the model).
    assert m["write"]["vm_hwm_growth_bytes"] < m["total_size_bytes"], m
    assert m["verify"]["rss_anon_peak_growth_bytes"] <= bound + (8 << 20), m
    assert m["max_logit_diff"] <= 1e-5, m


@pytest.mark.multirank
def test_export_weights_sharded_and_bf16(zero3_run, tmp_path):
    from transformers import AutoModelForCausalLM

    from harness.checkpoint.export.folder import export

    fp32 = assert_export_equals_engine(zero3_run, tmp_path / "fp32", max_shard_size=SHARD)
    assert fp32["dtype"] == "fp32" and fp32["max_logit_diff"] <= 1e-5  # the training dtype by default
    info = export(zero3_run, tmp_path / "bf16", max_shard_size="4MB", dtype="bf16")
    assert info["dtype"] == "bf16" and info["total_size_bytes"] * 2 == fp32["total_size_bytes"], info
    whole = dict(read_sharded(tmp_path / "fp32"))
    for name, tensor in read_sharded(tmp_path / "bf16"):
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, whole[name].to(torch.bfloat16)), name
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "bf16").dtype == torch.bfloat16


def _cli(capsys, *args: str) -> tuple[int, str]:
    """`harness export ...` through the CLI's own error handling (exit code, stderr), in this process."""
    from harness.cli import main

    code = main(["export", *args])
    return code, capsys.readouterr().err


@pytest.mark.multirank
def test_export_refusals_are_clear_and_write_nothing(zero3_run, tmp_path, capsys):
    code, err = _cli(capsys, str(zero3_run), "--out", str(tmp_path / "a"), "--max-shard-size", "12XB")
    assert code == 2 and "--max-shard-size '12XB'" in err and "fix:" in err and not (tmp_path / "a").exists()
    # A checkpoint whose probe disagrees with its weights: the logits check fails, the folder is not written.
    tag = tmp_path / "ckpt" / "global_step1"
    tag.mkdir(parents=True)
    for f in (zero3_run / "checkpoints" / "global_step1").iterdir():
        if f.name != "probe.pt":
            (tag / f.name).symlink_to(f)
    (tmp_path / "ckpt" / "hf").symlink_to(zero3_run / "checkpoints" / "hf")
    probe = torch.load(zero3_run / "checkpoints" / "global_step1" / "probe.pt", weights_only=True)
    torch.save({**probe, "logits": probe["logits"] + 0.5}, tag / "probe.pt")
    code, err = _cli(capsys, str(tag), "--out", str(tmp_path / "b"))
    assert code == 2 and "max |logit diff| 0.5 > tolerance 0.0001" in err and "fix: export in the training" in err, err
    assert not (tmp_path / "b").exists() and not list(tmp_path.glob(".b*"))
    # The same weights under a config with one layer fewer: refused before anything is read, naming the keys.
    (tmp_path / "ckpt" / "hf").unlink()
    shutil.copytree(zero3_run / "checkpoints" / "hf", tmp_path / "ckpt" / "hf")
    config = json.loads((tmp_path / "ckpt" / "hf" / "config.json").read_text())
    config["num_hidden_layers"] -= 1
    (tmp_path / "ckpt" / "hf" / "config.json").write_text(json.dumps(config))
    code, err = _cli(capsys, str(tag), "--out", str(tmp_path / "c"))
    assert code == 2 and "checkpoint does not match the model config" in err and "model.layers.7." in err, err
    assert not (tmp_path / "c").exists()
    shutil.rmtree(tmp_path / "ckpt")
