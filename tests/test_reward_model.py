"""train.objective=reward on 2 real ranks (ZeRO-2 and ZeRO-3: one launch of two cases): the
Bradley-Terry accuracy on the built-in pairs rises; the run exports (`harness export`) to a folder that
transformers' AutoModelForSequenceClassification loads and that rl.rewards loads as a reward model, with the same
scores; the exported model ranks chosen over rejected on the pairs it trained on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.launch import ROOT, env, launch_jobs, records

STEPS, MICRO = 80, 8  # ~6 passes over the built-in pairs: the pooled token (the final ".") learns slowly
PAIRS = [json.loads(line) for line in (ROOT / "harness/assets/preference.jsonl").read_text().splitlines()][:24]


def argv(folder: Path, recipe: str) -> list[str]:
    sets = {"precision": "fp32", "train.steps": STEPS, "train.seq_len": 48, "train.save_every": STEPS,
            "train.eval_every": STEPS, "train.log_every": 1, "scheduler.type": "none", "optimizer.lr": 3e-3, "optimizer.weight_decay": 0,
            "batch.micro_batch_per_gpu": MICRO, "batch.grad_accum_steps": 1, "batch.train_batch_size": '"auto"',
            "train.objective": "reward", "train.dataset": "builtin", "train.store_dir": folder / "stores"}
    out = ["--recipe", recipe, "--output-dir", str(folder / recipe)]
    for key, value in sets.items():
        out += ["--set", f"{key}={value}"]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("reward")
    launch_jobs([argv(folder, "zero2"), argv(folder, "zero3")], folder, timeout_s=600)
    out = {}
    for recipe in ("zero2", "zero3"):
        run = folder / recipe
        export = folder / f"{recipe}_export"
        subprocess.run([sys.executable, "-m", "harness.cli", "export", str(run), "--out", str(export)], cwd=ROOT,
                       env=env(), check=True, capture_output=True, text=True)
        out[recipe] = (run, export)
    return out


def scores(model, tokenizer, texts):
    import torch

    with torch.no_grad():
        enc = tokenizer(texts, padding=True, padding_side="right", add_special_tokens=False, return_tensors="pt")
        return model(**enc).logits[:, 0].tolist()


@pytest.mark.multirank
@pytest.mark.parametrize("recipe", ["zero2", "zero3"])
def test_accuracy_rises_on_the_builtin_pairs(runs, recipe):
    train = records(runs[recipe][0], "train")
    assert len(train) == STEPS
    first = sum(r["rewards_accuracy"] for r in train[:15]) / 15
    last = sum(r["rewards_accuracy"] for r in train[-15:]) / 15
    assert last > first + 0.1 and last >= 0.6, (first, last)
    assert sum(r["loss"] for r in train[-15:]) < sum(r["loss"] for r in train[:15])


@pytest.mark.multirank
@pytest.mark.parametrize("recipe", ["zero2", "zero3"])
def test_the_export_loads_in_transformers_and_rl_rewards_with_the_same_scores(runs, recipe):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from harness.rl.rewards import load_rewards

    export = runs[recipe][1]
    model = AutoModelForSequenceClassification.from_pretrained(export).eval()
    tokenizer = AutoTokenizer.from_pretrained(export)
    assert model.config.num_labels == 1 and type(model).__name__.endswith("ForSequenceClassification")
    prompts = [p["prompt"] for p in PAIRS] * 2
    completions = [p["chosen"] for p in PAIRS] + [p["rejected"] for p in PAIRS]
    direct = scores(model, tokenizer, [p + c for p, c in zip(prompts, completions)])
    rs = load_rewards({"rewards": [{"model": str(export)}]}, tokenizer=tokenizer, base_dir=".")
    via = [row[0] for row in rs.score(prompts=prompts, completions=completions, completion_ids=None, columns={})]
    assert via == pytest.approx(direct, abs=1e-5)
    chosen, rejected = direct[:len(PAIRS)], direct[len(PAIRS):]
    assert sum(c > r for c, r in zip(chosen, rejected)) / len(PAIRS) >= 0.6
