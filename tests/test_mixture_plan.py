"""`harness plan --datasets` and `harness data prepare` with a mixture (harness/data/mixture.plan_lines), in-process:
the sources' rows and tokens are their stores' own, the epochs and the steps to one epoch follow from the weights,
and a source with no store yet is named unknown."""

from __future__ import annotations

import json

import pytest

from harness.cli import main
from helpers.corpora import write_instruction


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixplan")
    write_instruction(root / "inst.jsonl", 120, seed=4)
    words = "alpha beta gamma delta one two three four five six".split()
    (root / "web.txt").write_text("".join(" ".join(words[(i + j) % 10] for j in range(50)) + "\n" for i in range(200)))
    sources = [{"dataset": str(root / "web.txt"), "weight": 3}, {"dataset": str(root / "inst.jsonl"), "format": "instruction",
                                                     "weight": 1}]
    datasets = json.dumps(sources)
    assert main(["data", "prepare", "--model", "tiny-llama", "--seq-len", "64", "--num-proc", "1",
                 "--set", f"train.store_dir={root}", "--set", f"train.datasets={datasets}"]) == 0
    return root, sources


def stores(root) -> dict:
    from harness.data.store import open_store

    out = {}
    for meta in root.glob("*/meta.json"):
        store = open_store(meta.parent, json.loads(meta.read_text())["key"])
        out[store.meta["format"]] = store
    return out


def test_plan_reads_the_mixture_from_its_stores(prepared, capsys):
    root, sources = prepared
    capsys.readouterr()
    argv = ["plan", "--model", "tiny-llama", "--gpus", "2", "--gpu-mem", "8GB", "--seq-len", "64", "--micro-batch", "4",
            "--steps", "500", "--store-dir", str(root), "--json", "--datasets", json.dumps(sources)]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)["data"]
    made = stores(root)
    assert data["global_batch"] == 8
    for src, fmt, share in zip(data["sources"], ("text", "instruction"), (0.75, 0.25)):
        store = made[fmt]
        train_rows = store.num_rows - max(1, round(store.num_rows * 0.02))
        assert (src["train_rows"], src["tokens"], src["share"]) == (train_rows, store.meta["tokens"], share)
        assert src["epochs"] == pytest.approx(500 * 8 * share / train_rows)
        assert src["steps_per_epoch"] == pytest.approx(train_rows / share / 8)
    assert data["first_out"] == min(data["sources"], key=lambda s: s["steps_per_epoch"])["name"]
    argv = argv[:argv.index("--json")] + ["--datasets", json.dumps(sources + [{"dataset": str(root / "x.jsonl"),
                                                                                "weight": 1}])]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"data: mixture of 3 sources, 8 rows of 64 tokens per step; {data['first_out']} runs out first" in out
    assert "x (weight 1 = 20.0%): no store yet: unknown" in out
