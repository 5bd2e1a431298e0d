"""Models and tokenizers: real transformers models, built, run, saved, reloaded, partitioned and trained."""

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from harness.model import hf as models  # noqa: E402
from harness.dist import free_port  # noqa: E402
from harness.errors import UsageError  # noqa: E402
from harness.model_shapes import PRESETS, TINY_VOCAB_SIZE  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TEXT = 'Once upon a time, Zoe found a blue kite.\nBob: What does a duck eat?\n7 + 5 = 12. café ✓'


def assert_same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    different = [k for k in sa if not torch.equal(sa[k], sb[k])]
    assert not different, f"weights differ: {different}"


@pytest.mark.parametrize("spec", sorted(PRESETS))
def test_presets_build_and_run_a_forward_pass(spec):
    model = models.build_model(spec, seed=0)
    tok = models.load_tokenizer(spec)
    ids = torch.tensor([tok(TEXT)["input_ids"]])
    out = model(input_ids=ids, labels=ids)
    assert out.logits.shape == (1, ids.shape[1], TINY_VOCAB_SIZE)
    assert torch.isfinite(out.loss) and abs(out.loss.item() - 6.24) < 0.3  # ~ln(512) at init
    assert model.config._attn_implementation == models.ATTN_IMPLEMENTATION
    assert model.config.eos_token_id == tok.eos_token_id
    # eos separates packed documents, so its embedding must train (no padding_idx freezing it at zero)
    assert getattr(model.get_input_embeddings(), "padding_idx", None) is None


@pytest.mark.parametrize("spec", sorted(PRESETS))
def test_same_seed_same_weights_and_another_seed_differs(spec):
    a = models.build_model(spec, seed=11)
    torch.randn(1000)  # global RNG state in between must not matter
    assert_same_weights(a, models.build_model(spec, seed=11))
    other = models.build_model(spec, seed=12).state_dict()
    assert not all(torch.equal(v, other[k]) for k, v in a.state_dict().items())


def test_shipped_tokenizer_round_trips_text_with_vocab_512():
    tok = models.load_tokenizer("tiny-llama")
    ids = tok(TEXT)["input_ids"]
    assert tok.decode(ids) == TEXT  # byte-level BPE: any text, including non-ASCII, survives
    assert len(tok) == TINY_VOCAB_SIZE and max(ids) < TINY_VOCAB_SIZE
    assert tok.eos_token == tok.pad_token == "<|endoftext|>"
    assert tok.convert_tokens_to_ids("<|endoftext|>") == tok.eos_token_id


def test_shipped_tokenizer_files_load_both_ways():
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    auto = AutoTokenizer.from_pretrained(str(models.ASSETS_DIR))
    fast = PreTrainedTokenizerFast(tokenizer_file=str(models.ASSETS_DIR / "tokenizer.json"),
                                   eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    assert auto.eos_token == auto.pad_token == "<|endoftext|>"
    ours = models.load_tokenizer("tiny-gpt2")
    assert auto(TEXT)["input_ids"] == fast(TEXT)["input_ids"] == ours(TEXT)["input_ids"]


def test_exported_folder_reloads_model_and_tokenizer(tmp_path):
    model = models.build_model("tiny-gpt2", seed=4)
    model.save_pretrained(tmp_path)
    models.load_tokenizer("tiny-gpt2").save_pretrained(tmp_path)
    assert_same_weights(model, models.build_model(str(tmp_path), seed=999))
    tok = models.load_tokenizer(str(tmp_path))
    assert tok.decode(tok(TEXT)["input_ids"]) == TEXT and tok.pad_token == "<|endoftext|>"
    assert models.load_model_config(str(tmp_path)).model_type == "gpt2"


def test_unknown_hub_id_offline_explains_the_fix(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    for load in (models.load_tokenizer, models.load_model_config):
        with pytest.raises(UsageError) as err:
            load("no-such-org/no-such-model")
        msg = str(err.value)
        assert "not a built-in preset (tiny-gpt2, tiny-llama, tiny-mixtral, tiny-qwen3-moe) nor a local directory" in msg
        assert "Offline mode is on (HF_HUB_OFFLINE=1)" in msg
        assert "fix: use a preset or a local model directory" in msg


def test_local_directory_without_model_files_explains_the_fix(tmp_path):
    with pytest.raises(UsageError, match=r"cannot load model config from directory .*\n.*fix: the directory needs "
                                         r"config.json \(write them with model.save_pretrained\(dir\)\)"):
        models.build_model(str(tmp_path), seed=0)
    with pytest.raises(UsageError, match="cannot load tokenizer from directory"):
        models.load_tokenizer(str(tmp_path))


def test_gradient_checkpointing_gives_the_same_loss_and_grads():
    ids = torch.randint(0, TINY_VOCAB_SIZE, (2, 32), generator=torch.Generator().manual_seed(0))
    results = []
    for ckpt in (False, True):
        model = models.build_model("tiny-llama", seed=1, gradient_checkpointing=ckpt)
        model.train()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((model, loss.item(), [p.grad.clone() for p in model.parameters()]))
    (_, loss_a, grads_a), (model_b, loss_b, grads_b) = results
    assert getattr(model_b, "is_activation_checkpointing", None) and model_b.config.use_cache is False
    assert loss_a == pytest.approx(loss_b, abs=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads_a, grads_b))


def test_zero3_config_must_be_stage_3():
    with pytest.raises(ValueError, match="zero_optimization.stage=2; zero.Init needs stage 3"):
        models.build_model("tiny-llama", seed=0, zero3_init_config={"zero_optimization": {"stage": 2}})


ZERO3_SCRIPT = textwrap.dedent("""
    import json, sys, torch, deepspeed
    from harness.model.hf import build_model, load_tokenizer
    cfg = {"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": 3}}
    out, folder = {}, sys.argv[1]
    def gathered(model):
        params = list(model.parameters())
        empty = all(p.numel() == 0 for p in params)  # partitioned at construction, never materialised
        with deepspeed.zero.GatheredParameters(params):
            return empty, {k: v.detach().clone() for k, v in model.state_dict().items()}
    for spec in ["tiny-llama", "tiny-gpt2"]:
        empty, z = gathered(build_model(spec, seed=7, zero3_init_config=cfg))
        plain = build_model(spec, seed=7).state_dict()  # after a ZeRO-3 build: must not be partitioned
        out[spec] = {"partitioned": empty, "differ": [k for k in plain if not torch.equal(plain[k], z[k])]}
    plain = build_model("tiny-llama", seed=3)
    plain.save_pretrained(folder)
    load_tokenizer("tiny-llama").save_pretrained(folder)
    empty, z = gathered(build_model(folder, seed=0, zero3_init_config=cfg, gradient_checkpointing=True))
    ref = plain.state_dict()
    out["folder"] = {"partitioned": empty, "differ": [k for k in ref if not torch.equal(ref[k], z[k])]}
    print("RESULT " + json.dumps(out))
""")


@pytest.mark.multirank
def test_zero3_init_partitions_and_matches_the_plain_build(tmp_path):
    """One real DeepSpeed rank (own process: zero.Init starts a process group): ZeRO-3 weights == plain."""
    env = dict(os.environ, PYTHONPATH=str(REPO), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    proc = subprocess.run([sys.executable, "-c", ZERO3_SCRIPT, str(tmp_path)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    for name in ("tiny-llama", "tiny-gpt2", "folder"):
        assert result[name] == {"partitioned": True, "differ": []}, (name, result[name])


def test_tiny_llama_learns_the_builtin_corpus(tmp_path):
    """60 AdamW steps of 16 x 128 tokens: the corpus has learnable structure and the pieces fit together."""
    from harness.data.batches import BatchPlan
    from harness.data.corpus import DataSpec
    from harness.data.rows import Rows
    from harness.data.store import prepare

    store, _ = prepare(DataSpec(), models.load_tokenizer("tiny-llama"), 128, str(tmp_path))
    blocks = Rows.of(store)
    plan = BatchPlan(num_rows=len(blocks), global_batch=16, micro_batch=16, grad_accum=1, seed=0)
    model = models.build_model("tiny-llama", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses, start = [], time.perf_counter()
    for step in range(60):
        ids, labels = blocks[plan.global_rows(step)].tensors()
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    print(f"tiny-llama loss {losses[0]:.3f} -> {losses[-1]:.3f} in 60 steps, {time.perf_counter() - start:.1f}s")
    assert losses[-1] < losses[0] - 1.5
