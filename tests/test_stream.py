"""train.streaming: the shard store (harness/data/shards.py, stream_writer.py) and its order (stream_rows.py).

In one process: the shards hold exactly a finished store's rows (tokens, loss mask, document positions); a writer
stopped after k shards and started again publishes the same shards as one that ran through; the order is a pure
function of the step on any number of data-parallel ranks, with epochs once the writer is done; a writer that dies
ends the waiting ranks with its reason. One 2-rank launch (test_streamed_run_equals_finished_store_and_resumes)
trains on a store while it is written, resumes during the writing, and matches a finished store step for step.
"""

from __future__ import annotations

import json
import os
import multiprocessing
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from helpers.corpora import chat_tokenizer, write_chat  # noqa: E402
from harness.data.corpus import DataSpec  # noqa: E402
from harness.data.rows import Rows  # noqa: E402
from harness.data.shards import ShardStore, WriterLost, read_json, shard_dir, stream_key, stream_path  # noqa: E402
from harness.data.store import prepare  # noqa: E402
from harness.data.stream_rows import StreamPlan, StreamRows  # noqa: E402
from harness.data import stream_writer  # noqa: E402
from harness.errors import UsageError  # noqa: E402
from harness.model.hf import load_tokenizer  # noqa: E402

SEQ = 16
SHARD_TOKENS = 5 * SEQ  # 5 rows per shard


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny-llama")


def text_corpus(path, docs: int = 120):
    rng = np.random.default_rng(0)
    words = ["cat", "dog", "fish", "gate", "Monday", "river", "stone", "blue", "runs", "sleeps"]
    path.write_text("".join(json.dumps({"text": " ".join(rng.choice(words, rng.integers(0, 30)))}) + "\n"
                            for _ in range(docs)))
    return path


def written(spec, tok, root, shard_tokens=SHARD_TOKENS, num_proc=1):
    key = stream_key(spec, tok, SEQ, shard_tokens)
    path = stream_path(key, str(root))
    stream_writer.write_store(spec, tok, key, path, num_proc)
    store = ShardStore(path, key)
    store.refresh()
    return store


def all_rows(store: ShardStore, packing: str):
    """Every row of the shard store in store order, as Rows.tensors gives them."""
    parts = []
    for k in range(store.num_shards):
        shard = store.shard(k)
        ends = shard.doc_ends if packing == "document" else None
        parts.append(Rows(shard.tokens, shard.loss_mask, np.arange(store.shard_size(k)), ends).tensors())
    return [torch.cat(p) for p in zip(*parts)]


@pytest.mark.parametrize("fmt", ["text", "chat"])
def test_shards_hold_the_finished_stores_rows(tmp_path, tok, fmt):
    if fmt == "chat":
        tok = chat_tokenizer()
        spec = DataSpec(str(write_chat(tmp_path / "chat.jsonl", 60)), format="chat")
    else:
        spec = DataSpec(str(text_corpus(tmp_path / "docs.jsonl")))
    finished, _ = prepare(spec, tok, SEQ, str(tmp_path / "stores"))
    store = written(spec, tok, tmp_path / "stores", num_proc=2 if fmt == "text" else 1)  # forked tokenizers too
    assert store.done and store.num_shards > 3 and store.rows == finished.num_rows
    assert store.manifest["documents"] <= finished.meta["documents"]
    for packing in ("concat", "document"):
        expected = Rows.of(finished, packing).tensors()
        for got, want in zip(all_rows(store, packing), expected, strict=True):
            assert torch.equal(got, want), packing


def stop_writer_after(shards: int, spec, tok, key, path) -> None:
    """Run the writer in this process and stop it (as SIGTERM does) right after it published `shards` shards,
    leaving also a shard folder renamed into place but not counted (what a kill between the two leaves)."""
    original = stream_writer.Packer.publish

    def publish(self, rows, done):
        original(self, rows, done)
        if self.manifest["shards"] == shards:
            shard_dir(path, shards).mkdir()
            raise SystemExit(143)
    stream_writer.Packer.publish = publish
    try:
        with pytest.raises(SystemExit):
            stream_writer.write_store(spec, tok, key, path)
    finally:
        stream_writer.Packer.publish = original
    assert read_json(path / "writer.json")["state"] == "stopped"
    assert read_json(path / "manifest.json")["shards"] == shards and not read_json(path / "manifest.json")["done"]


def test_restarted_writer_publishes_the_same_shards(tmp_path, tok):
    spec = DataSpec(str(text_corpus(tmp_path / "docs.jsonl", 300)))
    whole = written(spec, tok, tmp_path / "whole")
    key, path = whole.key, stream_path(whole.key, str(tmp_path / "cut"))
    stop_writer_after(3, spec, tok, key, path)
    before = (shard_dir(path, 0) / "tokens.bin").stat().st_mtime_ns
    stream_writer.write_store(spec, tok, key, path)
    assert (shard_dir(path, 0) / "tokens.bin").stat().st_mtime_ns == before  # reused, not rewritten
    again = ShardStore(path, key)
    again.refresh()
    assert again.manifest == {**whole.manifest}
    for k in range(whole.num_shards):
        for name in ("tokens.bin", "doc_index.bin"):
            assert (shard_dir(path, k) / name).read_bytes() == (shard_dir(whole.path, k) / name).read_bytes(), (k, name)


def stream_rows(store, eval_fraction=0.2, seed=3, packing="document"):
    held, first_train = store.first_split(eval_fraction, seed, packing)
    return StreamRows(store, first_train, packing), held


def plan(rows, dp_rank=0, dp_size=1, micro=2, accum=1, seed=7):
    return StreamPlan(rows, global_batch=micro * accum * dp_size, micro_batch=micro, grad_accum=accum,
                      dp_rank=dp_rank, dp_size=dp_size, seed=seed)


def test_order_is_a_function_of_the_step_on_any_world_size_with_epochs(tmp_path, tok):
    store = written(DataSpec(str(text_corpus(tmp_path / "docs.jsonl", 300))), tok, tmp_path / "s")
    rows, held = stream_rows(store)
    first = store.shard_size(0)
    assert len(held) == round(first * 0.2) and rows.known_rows == store.rows - len(held)
    single = plan(rows, micro=4)
    pair = [plan(rows, r, 2, micro=1, accum=2) for r in range(2)]
    spe = single.steps_per_epoch
    assert spe == rows.known_rows // 4 and spe > 3
    for step in range(2 * spe + 1):
        want = single.global_rows(step)
        assert torch.equal(torch.cat([torch.cat(p.micro_batches(step)) for p in pair]), want)
        assert single.epoch_of(step) == step // spe
    epoch0 = torch.cat([single.global_rows(s) for s in range(spe)])
    epoch1 = torch.cat([single.global_rows(s) for s in range(spe, 2 * spe)])
    assert len(set(epoch0.tolist())) == spe * 4 and not torch.equal(epoch0, epoch1)
    assert not set(epoch0.tolist()) & set(held.index.tolist())  # eval rows (shard 0's) never train
    shard = store.shard_rows  # each epoch goes shard by shard: a step's rows lie in one or two neighbouring shards
    assert all(int(single.global_rows(s).max()) // shard - int(single.global_rows(s).min()) // shard <= 1
               for s in range(spe))
    view = rows[single.global_rows(1)]
    ids, labels, positions = view.tensors()
    whole = Rows.of(prepare(DataSpec(str(tmp_path / "docs.jsonl")), tok, SEQ, str(tmp_path / "f"))[0], "document")
    want = whole[single.global_rows(1)].tensors()
    assert all(torch.equal(a, b) for a, b in zip((ids, labels, positions), want))


def partial_copy(store, dest, shards: int):
    """The store as its writer left it after `shards` shards (the files of the rest are there, not counted)."""
    import shutil

    shutil.copytree(store.path, dest)
    manifest = dict(store.manifest, shards=shards, rows=shards * store.shard_rows, done=False)
    (dest / "manifest.json").write_text(json.dumps(manifest))
    return ShardStore(dest, store.key)


def test_rows_while_written_equal_the_finished_stores_and_a_lost_writer_ends_the_wait(tmp_path, tok):
    store = written(DataSpec(str(text_corpus(tmp_path / "docs.jsonl", 300))), tok, tmp_path / "s")
    done_plan = plan(stream_rows(store)[0], micro=4)
    partial = partial_copy(store, tmp_path / "partial", 4)
    partial.refresh()
    live_rows = stream_rows(partial)[0]
    live = plan(live_rows, micro=4)
    ready = live_rows.known_rows // 4
    assert live.steps_per_epoch is None and ready >= 3
    for step in range(ready):
        assert torch.equal(live.global_rows(step), done_plan.global_rows(step))
    (partial.path / "writer.json").write_text(json.dumps({"state": "failed", "kind": "error", "pid": 1, "host": "h",
                                                          "at": time.time(), "error": "MemoryError: tokenizer"}))
    with pytest.raises(WriterLost, match="MemoryError: tokenizer"):
        live.global_rows(ready)
    (partial.path / "writer.json").unlink()
    partial.writer = multiprocessing.get_context("spawn").Process(target=sys.exit, args=(7,))  # a writer that died
    partial.writer.start()
    partial.writer.join()
    with pytest.raises(WriterLost, match="exited with code 7 before the store was done"):
        live.global_rows(ready)


def test_bad_record_in_the_stream_fails_the_writer_with_its_line(tmp_path, tok):
    path = text_corpus(tmp_path / "docs.jsonl", 300)
    with open(path, "a") as f:
        f.write('{"text": "fine"}\n{"text": broken\n')
    spec = DataSpec(str(path))
    key = stream_key(spec, tok, SEQ, SHARD_TOKENS)
    folder = stream_path(key, str(tmp_path))
    with pytest.raises(UsageError) as err:
        stream_writer.write_store(spec, tok, key, folder)
    status = read_json(folder / "writer.json")
    assert status["state"] == "failed" and status["kind"] == "usage" and str(path) in status["error"]
    reader = ShardStore(folder, key, _since=0)
    reader.refresh()
    with pytest.raises(UsageError, match=str(err.value).splitlines()[0][:40]):
        reader.wait(lambda s: False, "step 1")


@pytest.mark.multirank
def test_streamed_run_equals_finished_store_and_resumes(tmp_path, tok):
    """One 2-rank launch: L (a store written while it trains: an earlier writer stopped after 3 shards, L's writer
    continues, slowed to 0.3 s a shard; 6 steps, a checkpoint at 3; L stops its writer unfinished when it ends),
    R (--resume L's step 3 into a new folder: it reads the shards L's writer left) and F (the store finished
    beforehand). L's and F's losses and eval losses
    are equal step for step, and R's steps 4-6 equal F's; the shards written across the restart equal F's."""
    from helpers.launch import job_output, launch_jobs, losses, records
    from helpers.parity import common_args

    seq, micro, steps = 32, 2, 6
    corpus = text_corpus(tmp_path / "docs.jsonl", 700)
    spec = DataSpec(str(corpus))
    shard_tokens = 4 * seq
    finished = stream_path(stream_key(spec, tok, seq, shard_tokens), str(tmp_path / "finished"))
    stream_writer.write_store(spec, tok, stream_key(spec, tok, seq, shard_tokens), finished)
    total = read_json(finished / "manifest.json")["shards"]
    args = ["--recipe", "zero2", "--set", "precision=fp32", *common_args(steps, seq, micro, save_every=3),
            "--set", "train.eval_every=3", "--set", "train.eval_fraction=0.25", "--set", f"train.dataset={corpus}",
            "--set", "train.streaming=true", "--set", f"train.stream_shard_tokens={shard_tokens}"]
    live_store = stream_path(stream_key(spec, tok, seq, shard_tokens), str(tmp_path / "live"))
    stop_writer_after(3, spec, tok, stream_key(spec, tok, seq, shard_tokens), live_store)
    live = ["--set", f"train.store_dir={tmp_path / 'live'}"]
    cases = [[*args, *live, "--output-dir", str(tmp_path / "L")],
             [*args, *live, "--output-dir", str(tmp_path / "R"), "--resume",
              str(tmp_path / "L" / "checkpoints" / "global_step3")],
             [*args, "--set", f"train.store_dir={tmp_path / 'finished'}", "--output-dir", str(tmp_path / "F")]]
    os.environ[stream_writer.PAUSE_ENV] = "0.3"  # 243 shards: minutes, far longer than L
    try:
        proc = launch_jobs(cases, tmp_path)
    finally:
        del os.environ[stream_writer.PAUSE_ENV]
    first, resumed, done = (job_output(proc.stdout, i) for i in range(3))
    assert "(being written)" in first and "(done)" in done and "stream writer stopped" not in done, first[-3000:]
    stopped = [int(line.split("stopped at ")[1].split()[0]) for line in first.splitlines() if "writer stopped" in line]
    assert stopped and stopped[0] < total, first[-3000:]  # L ended with its writer unfinished
    assert losses(tmp_path / "L") == losses(tmp_path / "F") and sorted(losses(tmp_path / "F")) == [1, 2, 3, 4, 5, 6]
    evals = [{r["step"]: r["eval_loss"] for r in records(tmp_path / run, "eval")} for run in ("L", "F")]
    assert evals[0] == evals[1] and sorted(evals[0]) == [3, 6]
    waits = [json.loads((tmp_path / run / "summary.json").read_text())["stream_wait_s"] for run in "LRF"]
    assert waits[2] == 0 and all(w >= 0 for w in waits), waits  # a finished store never waits
    assert losses(tmp_path / "R") == {s: v for s, v in losses(tmp_path / "F").items() if s > 3}
    log = (live_store / "writer.log").read_text()
    assert "continuing after shard 3 " in log, log  # L's writer went on from the 3 shards an earlier one left
    assert f"(being written): {stopped[0]} shards" in resumed, resumed[-3000:]  # R reads L's shards, and more
    manifest = read_json(live_store / "manifest.json")
    for k in range(manifest["shards"]):
        for name in ("tokens.bin", "doc_index.bin"):
            assert (shard_dir(live_store, k) / name).read_bytes() == (shard_dir(finished, k) / name).read_bytes()
    print(f"streaming: L stopped its writer at {stopped[0]} of {total} shards; {manifest['shards']} after R")


def test_a_rank_that_catches_up_waits_with_a_progress_line(tmp_path, tok, capsys):
    import threading

    store = written(DataSpec(str(text_corpus(tmp_path / "docs.jsonl", 300))), tok, tmp_path / "s")
    partial = partial_copy(store, tmp_path / "partial", 4)
    partial.talk = True
    partial.refresh()
    rows = stream_rows(partial)[0]
    live = plan(rows, micro=4)
    ready = rows.known_rows // 4
    publish = threading.Timer(1.5, lambda: (partial.path / "manifest.json").write_text(json.dumps(store.manifest)))
    publish.start()
    start = time.monotonic()
    got = live.global_rows(ready)  # past the published rows: waits until the "writer" publishes the rest
    waited = time.monotonic() - start
    publish.join()
    assert 1.4 < waited < 10 and partial.waited_s >= 1.4
    assert torch.equal(got, plan(stream_rows(store)[0], micro=4).global_rows(ready))
    out = capsys.readouterr().out
    assert f"step {ready + 1} waits for the stream writer: 20 rows in 4 shards published" in out, out


def test_a_second_writer_waits_for_the_first_and_writes_nothing(tmp_path, tok, monkeypatch, capsys):
    """Two writers of one store (two runs, or two nodes on a shared folder): the second waits on the store's lock
    as a standby and, the first done, finds the store done."""
    import threading

    spec = DataSpec(str(text_corpus(tmp_path / "docs.jsonl", 50)))
    key = stream_key(spec, tok, SEQ, SHARD_TOKENS)
    path = stream_path(key, str(tmp_path))
    monkeypatch.setenv(stream_writer.PAUSE_ENV, "0.02")
    first = threading.Thread(target=stream_writer.write_store, args=(spec, tok, key, path, 1))
    first.start()
    while read_json(path / "manifest.json") is None or read_json(path / "manifest.json")["shards"] < 2:
        time.sleep(0.01)
    second = stream_writer.write_store(spec, tok, key, path, 1)  # blocks on the lock until the first is done
    first.join()
    assert second["done"] and second == read_json(path / "manifest.json")
    assert read_json(path / "writer.json")["state"] == "done"
    out = capsys.readouterr().out
    assert out.count("starting at shard 0") == 1 and "continuing" not in out, out  # the second one wrote nothing
