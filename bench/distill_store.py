"""The precomputed teacher store (harness/distill/teacher_store.py): its disk bytes per loss token and its write time,
per k, beside the formula (k ids + k float32 log-probs + one float32 actual-token log-prob), and the time to read
it back (what a run pays instead of the teacher's forward).

    python bench/distill_store.py [--rows 64] [--seq-len 256] [--ks 1,8,32] [--vocab 32000] [--micro 8] [--keep DIR]

A Llama-shaped teacher (seeded random weights; hidden 256, 4 layers, the given vocabulary: ids are uint16 up to
65,536 tokens, else uint32) scores `rows` rows of seq_len random tokens whose second half carries loss (a prompt +
completion layout), one micro-batch at a time, on this process's CPU threads. Per k: tokens, bytes per token
(formula and measured on disk, the row index included), write seconds, loss tokens/s written, and the read time
of every row through TeacherStore.rows. Everything goes under a temporary folder deleted at the end (unless --keep).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def teacher(vocab: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=4096)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def rows(num_rows: int, seq_len: int, vocab: int):
    import numpy as np

    gen = np.random.default_rng(0)
    ids = gen.integers(0, vocab, size=(num_rows, seq_len)).astype(np.int64)
    labels = ids.copy()
    labels[:, :seq_len // 2] = -100
    return ids, labels


def one_k(folder: Path, model, ids, labels, k: int, vocab: int, micro: int) -> dict:
    import numpy as np
    import torch

    from harness.distill.teacher_store import bytes_per_token, ensure_teacher_store, store_key, store_path
    from harness.distill.topk import teacher_topk

    def batch(row_ids):
        return torch.from_numpy(ids[row_ids]), torch.from_numpy(labels[row_ids])

    def forward(input_ids, row_labels):
        with torch.no_grad():
            return teacher_topk(model(input_ids=input_ids, use_cache=False).logits, row_labels, k, 1.0)

    key = store_key(teacher="bench", weights=[0], data={"seq_len": ids.shape[1]}, k=k, temperature=1.0,
                    precision="fp32")
    started = time.perf_counter()
    store, written = ensure_teacher_store(store_path(folder, key), key, num_rows=len(ids), batch=batch,
                                          teacher=forward, micro=micro, vocab_size=vocab)
    wall_s = time.perf_counter() - started
    assert written
    started = time.perf_counter()
    got = store.rows(np.arange(len(ids)))
    read_s = time.perf_counter() - started
    tokens = store.meta["tokens"]
    on_disk = sum(p.stat().st_size for p in store.path.glob("*.bin"))
    assert len(got) == tokens and store.meta["bytes_per_token"] == bytes_per_token(k, vocab)
    return {"k": k, "tokens": tokens, "bytes_per_token": bytes_per_token(k, vocab),
            "measured_bytes_per_token": on_disk / tokens, "write_s": store.meta["write_s"], "wall_s": wall_s,
            "tokens_per_s": tokens / store.meta["write_s"], "read_s": read_s}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--ks", default="1,8,32")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--keep")
    args = parser.parse_args(argv)
    folder = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="distill_store-"))
    model = teacher(args.vocab)
    ids, labels = rows(args.rows, args.seq_len, args.vocab)
    print(f"teacher: Llama hidden 256, 4 layers, vocab {args.vocab}; {args.rows} rows x {args.seq_len} tokens, "
          f"half of each row carries loss; micro-batch {args.micro}")
    print(f"{'k':>4} {'tokens':>8} {'B/token':>8} {'measured':>9} {'write s':>8} {'tokens/s':>9} {'read s':>7}")
    try:
        for k in (int(x) for x in args.ks.split(",")):
            r = one_k(folder, model, ids, labels, k, args.vocab, args.micro)
            print(f"{r['k']:>4} {r['tokens']:>8} {r['bytes_per_token']:>8} {r['measured_bytes_per_token']:>9.2f} "
                  f"{r['write_s']:>8.2f} {r['tokens_per_s']:>9.0f} {r['read_s']:>7.3f}")
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
