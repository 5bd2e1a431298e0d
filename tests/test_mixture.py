"""Mixtures on real DeepSpeed ranks (CPU, fp32, a tiny-llama folder with a chat template): three sources (text,
instruction, chat; weights 0.5 / 0.3 / 0.2) read by the blend index (harness/data/blend.py).

One 2-rank launch runs: A, ZeRO-2 dp2 for 6 steps (saves step 3); B, tp2 for 3 steps; C, ZeRO-2 resumed from B's
step 3; D, ZeRO-2 resumed from A's step 3 with the weights changed to 0.2 / 0.3 / 0.5. One 1-rank launch runs E,
resumed from A's step 3. Every case reads micro-batches of 2 rows (A, C, D: 2 accum x 2 dp; B, E: 4 accum), so a
step's rows fall into the same micro-batches whatever the layout and the losses can be compared.

Checked: rows/<name> (what the ranks fetched, summed over replicas) meet the one-row bound at every step and equal
the blend's counts; loss/<name> equals each source's mean token loss computed alone, in this process, on the same
rows with the same weights (the model folder at step 1, A's step-3 checkpoint at step 4); eval_loss/<name> is
logged, and the report has a Sources table and plot; C and E continue A (2 -> 1 ranks, tp2 -> ZeRO-2); D says the weights changed and from row 24 on follows
the new ones, with the rows read before kept.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from helpers.corpora import chat_model_dir, write_chat, write_instruction
from helpers.launch import job_output, launch, launch_jobs, losses, records

pytestmark = pytest.mark.multirank

WEIGHTS = {"text": 0.5, "inst": 0.3, "chat": 0.2}
CHANGED = {"text": 0.2, "inst": 0.3, "chat": 0.5}
RTOL = 1e-5  # tp2 -> ZeRO-2 measured below 1e-6 (tests/test_relayout.py's bound)


def write_text(path, num: int, seed: int):
    rng = random.Random(seed)
    words = "alpha beta gamma delta one two three four five six".split()
    with open(path, "w") as f:
        for _ in range(num):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(20, 60)))}) + "\n")
    return path


def datasets(folder, weights: dict) -> str:
    files = {"text": ("text.jsonl", "text"), "inst": ("inst.jsonl", "instruction"), "chat": ("chat.jsonl", "chat")}
    return json.dumps([{"dataset": str(folder / files[n][0]), "format": files[n][1], "weight": w, "name": n}
                       for n, w in weights.items()])


def case(root, out, recipe: str, accum: int, steps: int, *extra: str, weights=WEIGHTS) -> list[str]:
    return ["--recipe", recipe, "--set", "precision=fp32", "--set", "train.seq_len=32",
            "--set", f"train.model={root / 'model'}", "--set", f"train.store_dir={root / 'stores'}",
            "--set", "scheduler.type=none", "--set", "train.log_every=1", "--set", "train.eval_every=0",
            "--set", "train.eval_batches=2", "--set", 'batch.train_batch_size="auto"',
            "--set", "batch.micro_batch_per_gpu=2", "--set", f"batch.grad_accum_steps={accum}",
            "--set", f"train.steps={steps}", "--set", "train.save_every=3", "--profile-steps", "",
            "--set", f"train.datasets={datasets(root, weights)}", "--output-dir", str(out), *extra]


def resume(run, step: int = 3) -> list[str]:
    return ["--resume", str(run / "checkpoints" / f"global_step{step}")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixture")
    write_text(root / "text.jsonl", 200, 1)
    write_instruction(root / "inst.jsonl", 200, seed=2)
    write_chat(root / "chat.jsonl", 200, seed=3)
    chat_model_dir(root / "model", 7)
    prepare_stores(root)
    r = {name: root / name for name in "ABCDE"}
    two = launch_jobs([case(root, r["A"], "zero2", 2, 6), case(root, r["B"], "tp", 4, 3),
                       case(root, r["C"], "zero2", 2, 6, *resume(r["B"])),
                       case(root, r["D"], "zero2", 2, 6, *resume(r["A"]), weights=CHANGED)], root)
    launch(*case(root, r["E"], "zero2", 4, 6, *resume(r["A"])), ranks=1)
    return {"root": root, "out": two.stdout, **r}


def prepare_stores(root) -> None:
    """The three stores, made here in this process (the launch finds them: no preparing child per source)."""
    from harness.data import mixture
    from harness.data.store import prepare
    from harness.model.hf import load_tokenizer

    tokenizer = load_tokenizer(str(root / "model"))
    train = {"datasets": json.loads(datasets(root, WEIGHTS)), "format": "text", "dataset_config": "",
             "dataset_split": "train"}
    for src in mixture.sources(train):
        prepare(src.spec, tokenizer, 32, str(root / "stores"), num_proc=1)


def mixture_data(root, weights=WEIGHTS):
    """The launch's mixture, loaded in this process (the stores the launch made)."""
    from harness.data import mixture
    from harness.model.hf import load_tokenizer

    train = {"datasets": json.loads(datasets(root, weights)), "model": str(root / "model"), "seq_len": 32,
             "store_dir": str(root / "stores"), "packing": "document", "eval_fraction": 0.02, "seed": 1234,
             "format": "text", "dataset_config": "", "dataset_split": "train"}
    mix, rows, _, _ = mixture.load(train, 0, load_tokenizer(train["model"]))
    return mix, rows


def plan_of(mix, rows):
    from harness.data.mix_rows import MixPlan

    return MixPlan(sizes=tuple(rows.sizes), blend=mix.blend, global_batch=8, micro_batch=8, grad_accum=1, seed=1234)


def test_rows_per_source_meet_the_one_row_bound(runs):
    mix, rows = mixture_data(runs["root"])
    plan = plan_of(mix, rows)
    read = np.zeros(3)
    for record in records(runs["A"], "train"):
        step = record["step"]
        read += [record[f"rows/{n}"] for n in WEIGHTS]
        assert read.sum() == 8 * step
        assert np.abs(read - 8 * step * np.array(list(WEIGHTS.values()))).max() < 1, (step, read)
        assert read.tolist() == plan.counts(step).tolist()
    assert "epochs over steps 1..6: text" in job_output(runs["out"], 0)


def source_losses(model, rows, ids) -> dict[int, float]:
    """Mean token loss of each source's rows of `rows`, computed alone."""
    from harness.data.rows import model_inputs

    out = {}
    for s in np.unique(ids):
        batch = rows[np.flatnonzero(ids == s)].tensors()
        with torch.no_grad():
            logits = model(**model_inputs(batch), use_cache=False).logits
        labels = batch[1][:, 1:]
        out[int(s)] = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                        labels.reshape(-1), ignore_index=-100).item()
    return out


def test_source_losses_equal_each_source_alone(runs):
    from transformers import AutoModelForCausalLM

    mix, rows = mixture_data(runs["root"])
    plan = plan_of(mix, rows)
    logged = {r["step"]: r for r in records(runs["A"], "train")}
    model = AutoModelForCausalLM.from_pretrained(runs["root"] / "model", dtype=torch.float32).eval()
    state = torch.load(runs["A"] / "checkpoints" / "global_step3" / "mp_rank_00_model_states.pt",
                       map_location="cpu", weights_only=False)["module"]
    checked = 0
    for step, weights in ((1, None), (4, state)):
        if weights is not None:
            model.load_state_dict(weights)
        step_rows = rows[plan.global_rows(step - 1)]
        for s, loss in source_losses(model, step_rows, step_rows.source_ids()).items():
            got = logged[step][f"loss/{mix.names[s]}"]
            if np.isnan(loss):  # the source's rows of this step hold no target (a prompt filling seq_len)
                assert got is None, (step, mix.names[s], got)
                continue
            checked += 1
            assert got == pytest.approx(loss, rel=1e-5), (step, mix.names[s], got, loss)
    assert checked >= 5
    (final,) = records(runs["A"], "eval")
    assert all(np.isfinite(final[f"eval_loss/{n}"]) for n in WEIGHTS)


def test_resume_on_other_layouts_continues_the_run(runs):
    want = {r["step"]: r for r in records(runs["A"], "train")}
    for name in ("C", "E"):  # tp2 -> ZeRO-2; 2 ranks -> 1
        got = {r["step"]: r for r in records(runs[name], "train")}
        assert sorted(got) == [4, 5, 6], (name, sorted(got))
        for step, record in got.items():
            for key in ["loss", *(f"loss/{n}" for n in WEIGHTS)]:
                if want[step][key] is None:  # no target in that source's rows of the step
                    assert record[key] is None, (name, step, key)
                    continue
                assert record[key] == pytest.approx(want[step][key], rel=RTOL), (name, step, key)
            assert all(record[f"rows/{n}"] == want[step][f"rows/{n}"] for n in WEIGHTS)
    assert sorted(losses(runs["B"])) == [1, 2, 3]


def test_changed_weights_continue_from_rows_read(runs):
    out = job_output(runs["out"], 3)
    assert "weights changed at row 24: text 0.5 -> 0.2, inst 0.3 -> 0.3, chat 0.2 -> 0.5" in out
    assert "rows read so far are kept (text 12, inst 7, chat 5)" in out
    since = np.zeros(3)
    for record in records(runs["D"], "train"):
        since += [record[f"rows/{n}"] for n in CHANGED]
        done = 8 * (record["step"] - 3)
        assert np.abs(since - done * np.array(list(CHANGED.values()))).max() < 1, (record["step"], since)
    client = torch.load(runs["D"] / "checkpoints" / "global_step6" / "mp_rank_00_model_states.pt",
                        map_location="cpu", weights_only=False)
    assert client["blend"] == [{"start": 0, "weights": [5, 3, 2]}, {"start": 24, "weights": [2, 3, 5]}]


def test_report_says_each_source(runs):
    from harness.report.compare import write_report

    text = write_report(runs["A"]).read_text()
    assert "## Sources (train.datasets)" in text and "Blend period 10 rows" in text
    line = next(x for x in text.splitlines() if x.startswith("| chat |"))
    assert "| 0.2 |" in line
    assert "series: loss/chat, eval_loss/chat, loss/inst" in text and (runs["A"] / "sources.png").exists()
    (start,) = records(runs["A"], "mixture")
    assert [s["name"] for s in start["sources"]] == list(WEIGHTS) and start["note"] is None
    epochs = {s["name"]: s["epochs"] for s in start["sources"]}
    train = {s["name"]: s["train_rows"] for s in start["sources"]}
    assert epochs["text"] == pytest.approx(24 / train["text"])  # 6 steps x 8 rows x 0.5
