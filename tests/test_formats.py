"""Instruction and chat formats: which tokens carry loss, exactly, after packing."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from helpers.corpora import chat_tokenizer, write_chat, write_instruction  # noqa: E402
from harness.errors import UsageError  # noqa: E402
from harness.data.corpus import DataSpec  # noqa: E402
from harness.model.hf import build_model, load_tokenizer  # noqa: E402
from harness.data.rows import IGNORE_INDEX, Rows  # noqa: E402
from harness.data.store import prepare  # noqa: E402


def _spans(store) -> tuple[str, str]:
    """(text of the tokens that carry loss, text of those that do not), over the whole store."""
    tok = load_tokenizer("tiny-llama")
    ids = np.fromfile(store.path / "tokens.bin", dtype=store.meta["dtype"])
    mask = np.fromfile(store.path / "loss_mask.bin", dtype=np.uint8).astype(bool)
    return tok.decode(ids[mask].tolist()), tok.decode(ids[~mask].tolist())


def test_instruction_loss_is_on_response_and_eos_only(tmp_path):
    path = write_instruction(tmp_path / "i.jsonl", 30, prompt="q", response="a")
    spec = DataSpec(str(path), format="instruction", prompt_field="q", response_field="a")
    store, _ = prepare(spec, load_tokenizer("tiny-llama"), 16, str(tmp_path / "stores"))
    records = [json.loads(line) for line in path.read_text().splitlines()]
    trained, masked = _spans(store)
    assert trained == "".join(r["a"] + "<|endoftext|>" for r in records)
    assert masked == "".join(r["q"] for r in records)
    assert store.meta["loss_tokens"] == int(np.fromfile(store.path / "loss_mask.bin", np.uint8).sum())
    with pytest.raises(UsageError, match=r"no column 'prompt' \(train.prompt_field, format 'instruction'\) in "
                                         r"its first 30 records; their columns are: q, a\n    fix: set train.prompt_field"):
        prepare(DataSpec(str(path), format="instruction"), load_tokenizer("tiny-llama"), 16, str(tmp_path))


def test_chat_loss_is_on_assistant_turns_only(tmp_path):
    path = write_chat(tmp_path / "c.jsonl", 30)
    store, _ = prepare(DataSpec(str(path), format="chat"), chat_tokenizer(), 16, str(tmp_path / "stores"))
    trained, masked = _spans(store)
    conversations = [json.loads(line)["messages"] for line in path.read_text().splitlines()]
    assert trained == "".join(m["content"] + "\n" for c in conversations for m in c if m["role"] == "assistant")
    assert masked.startswith("<|system|>You sort words.\n<|user|>") and masked.count("<|endoftext|>") == 30
    assert masked.count("<|assistant|>") == sum(m["role"] == "assistant" for c in conversations for m in c)


def test_missing_chat_template_names_the_model_and_the_fix(tmp_path):
    with pytest.raises(UsageError) as err:
        prepare(DataSpec(str(write_chat(tmp_path / "c.jsonl", 2)), format="chat"), chat_tokenizer(None), 16,
                str(tmp_path))
    assert "train.format is 'chat' but the tokenizer of model" in str(err.value)
    assert "fix: use a model whose tokenizer_config.json" in str(err.value)
    from harness.cli import main

    assert main(["data", "prepare", "--dataset", str(tmp_path / "c.jsonl"), "--model", "tiny-llama",
                 "--seq-len", "16", "--format", "chat", "--out", str(tmp_path)]) == 2


def test_masked_tokens_carry_no_loss(tmp_path):
    """The model's loss on packed rows equals cross-entropy over the response tokens alone, and changing the
    prompt tokens' labels (not their inputs) cannot change it: they are -100."""
    path = write_instruction(tmp_path / "i.jsonl", 40)
    store, _ = prepare(DataSpec(str(path), format="instruction"), load_tokenizer("tiny-llama"), 32,
                       str(tmp_path / "stores"))
    ids, labels = Rows.of(store)[:6].tensors()
    mask = torch.from_numpy(store.loss_mask[:6].astype(bool))
    assert torch.equal(labels == IGNORE_INDEX, ~mask) and 0 < mask.sum() < mask.numel()
    net = build_model("tiny-llama", seed=0).float().eval()
    with torch.no_grad():
        loss = net(input_ids=ids, labels=labels).loss
        logits = net(input_ids=ids).logits
    targets = mask[:, 1:]  # position t predicts token t + 1
    manual = torch.nn.functional.cross_entropy(logits[:, :-1][targets], ids[:, 1:][targets])
    torch.testing.assert_close(loss, manual, rtol=1e-6, atol=1e-6)
    everything = net(input_ids=ids, labels=ids).loss.detach()
    assert abs(float(everything) - float(loss)) > 1e-3  # the mask matters


def test_rows_without_targets_are_counted_and_train_with_loss_zero_not_nan(tmp_path):
    """A prompt longer than seq_len packs into rows with no target token: the store counts them (and the user
    is told), and the trainer's loss on such a micro-batch is 0 with zero gradients instead of 0/0 = NaN, while
    on any other micro-batch it equals HF's own mean loss bit for bit; so does the pipeline's loss."""
    from harness.model.parallel.pipeline import causal_lm_loss
    from harness.data.store import empty_rows_note
    from harness.train.trainer import _forward

    path = tmp_path / "i.jsonl"
    long_prompt = " ".join(["seven"] * 200)  # ~200 tokens of prompt: several 16-token rows of it alone
    path.write_text("".join(json.dumps({"prompt": p, "response": " cat dog"}) + "\n"
                            for p in (long_prompt, "Repeat: a b", long_prompt, "Say: c")))
    store, _ = prepare(DataSpec(str(path), format="instruction"), load_tokenizer("tiny-llama"), 16,
                       str(tmp_path / "stores"))
    mask = store.loss_mask[:store.num_rows].astype(bool)
    empty = ~mask[:, 1:].any(axis=1)
    assert store.meta["rows_without_loss"] == int(empty.sum()) >= 20
    assert f"{int(empty.sum())} of {store.num_rows} rows have no target token" in empty_rows_note(store.meta)
    net = build_model("tiny-llama", seed=0).float()
    rows = Rows.of(store)
    all_masked = rows[np.flatnonzero(empty)[:2]].tensors()
    loss = _forward(net, all_masked).loss
    loss.backward()
    grads = [p.grad for p in net.parameters() if p.grad is not None]
    assert float(loss.detach()) == 0.0 and grads and all(float(g.abs().max()) == 0.0 for g in grads)
    assert torch.isnan(net(input_ids=all_masked[0], labels=all_masked[1]).loss)  # what HF's mean gives
    mixed = rows[np.flatnonzero(~empty)[:2]].tensors()
    with torch.no_grad():
        assert torch.equal(_forward(net, mixed).loss, net(input_ids=mixed[0], labels=mixed[1]).loss)
        logits = net(input_ids=all_masked[0]).logits
        assert float(causal_lm_loss(logits, all_masked[1])) == 0.0
        logits = net(input_ids=mixed[0]).logits
        assert torch.equal(causal_lm_loss(logits, mixed[1]), net(input_ids=mixed[0], labels=mixed[1]).loss)
