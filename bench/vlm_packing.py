"""Packing for vision-language runs (harness/data/vision_pack.py): what packing saves and what its per-conversation
positions cost, side by side in one invocation, in process on one CPU process (no ranks: the ratios are the point).

    python bench/vlm_packing.py [--size tiny|small] [--records 48] [--image-size 112] [--seq-len 512] [--repeats 2]
                                [--device cpu|cuda] [--attention sdpa|flash_attention_2|flex_attention|eager]

A Qwen2-VL of bench/vlm.py's size, a chat JSONL where every other record has one image (the rest text only), the
vision store at --seq-len. The same conversations run forward + backward (fp32, micro-batch 1) two ways:
    packed       the store's rows (whole conversations packed, train.packing=document: per-conversation positions,
                 Qwen-VL's 3-D ones computed per conversation, the document mask)
    one per row  each conversation alone in a row of --seq-len, right-padded (the layout before packing)
Reported: rows, the share of positions that are padding, conversations/s each way and their ratio, the summed loss
of all conversations both ways (equal where the document mask and positions hold: the check for flash-attention's
varlen and flex_attention on a GPU, bench/gpu_check.sh's vlm_packing case), and the time spent computing the packed
rows' positions (harness/model/vision_positions.packed_rope) against one get_rope_index over the whole row, per row.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from vlm import write_data, write_model  # noqa: E402  the same model and data as bench/vlm.py


def rows(folder: Path, data: Path, seq_len: int, store: Path):
    from harness.model.hf import load_tokenizer
    from harness.train.vision_steps import load_data

    recipe = {"train": {"model": str(folder), "dataset": str(data), "format": "chat", "seq_len": seq_len,
                        "store_dir": str(store), "eval_fraction": 0, "seed": 0, "messages_field": "messages",
                        "packing": "document"}}
    return load_data(SimpleNamespace(recipe=recipe), SimpleNamespace(local_rank=0), load_tokenizer(str(folder)))[0]


def _spans(ids, token: int) -> int:
    """Image placeholder spans in a conversation's ids (each span is one image)."""
    import torch

    hit = ids == token
    return int((hit & ~torch.cat([torch.tensor([False]), hit[:-1]])).sum())


def one_per_row(packed, seq_len: int, pad: int, token: int) -> list[tuple]:
    """Each conversation of the packed rows alone in a right-padded row of seq_len, with its own images."""
    import torch

    from harness.data.vision import Images

    out, docs, bounds = [], packed.arrays["row_docs"], packed.arrays["doc_bounds"]
    for r in range(len(packed)):
        ids, labels, images, _ = packed[r:r + 1].tensors()
        taken = 0
        for lo, hi in bounds[int(docs[r]):int(docs[r + 1])]:
            spans = _spans(ids[0, lo:hi], token)
            row, lab = torch.full((1, seq_len), pad), torch.full((1, seq_len), -100)
            row[0, :hi - lo], lab[0, :hi - lo] = ids[0, lo:hi], labels[0, lo:hi]
            out.append((row, lab, Images(images.pixels[taken:taken + spans], images.grids[taken:taken + spans])))
            taken += spans
    return out


def timed(model, batches, repeats: int, device: str) -> tuple[float, float]:
    """(seconds per pass over the batches, the summed cross-entropy over every target of the last pass)."""
    import torch

    from harness.data.rows import loss_items

    start, total = time.perf_counter(), 0.0
    for _ in range(repeats):
        total = torch.zeros((), dtype=torch.float64, device=device)
        for batch in batches:
            ids, labels, images, *positions = batch
            items = loss_items(labels)
            model.zero_grad(set_to_none=True)
            loss = model(input_ids=ids.to(device), labels=labels.to(device), images=images,
                         num_calls=max(1, len(images)), per_call=8, use_cache=False, num_items_in_batch=items,
                         position_ids=positions[0].to(device) if positions else None).loss
            loss.backward()
            total += loss.detach().double() * items.item()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats, float(total)


def rope_cost(model, packed, token: int) -> tuple[float, float]:
    """Seconds per row: packed_rope (per conversation) and one get_rope_index over the whole row."""
    import torch

    from harness.model.vision_positions import packed_rope

    per_doc = whole = 0.0
    for r in range(len(packed)):
        ids, _, images, positions = packed[r:r + 1].tensors()
        kinds = (ids == token).int()
        grids = torch.stack(images.grids) if len(images) else None
        start = time.perf_counter()
        packed_rope(model, ids, positions, kinds, {1: grids})
        middle = time.perf_counter()
        model.model.get_rope_index(ids, mm_token_type_ids=kinds, image_grid_thw=grids)
        per_doc, whole = per_doc + middle - start, whole + time.perf_counter() - middle
    return per_doc / len(packed), whole / len(packed)


def main(argv=None) -> int:
    import torch
    from transformers import AutoModelForImageTextToText

    from harness.model import vision

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=("tiny", "small"), default="tiny")
    parser.add_argument("--records", type=int, default=48)
    parser.add_argument("--image-size", type=int, default=112)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--attention", default="sdpa", help="the transformers attn_implementation")
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="bench_vlm_packing_"))
    try:
        write_model(root / "model", args.size)
        data = write_data(root / "data", args.records, args.image_size)
        packed = rows(root / "model", data, args.seq_len, root / "stores")
        model = AutoModelForImageTextToText.from_pretrained(root / "model", dtype=torch.float32,
                                                            attn_implementation=args.attention).to(args.device)
        vision.install(model)
        token = vision.image_token_id(model.config)
        from harness.model.hf import load_tokenizer

        alone = one_per_row(packed, args.seq_len, load_tokenizer(str(root / "model")).pad_token_id, token)
        batches = [packed[r:r + 1].tensors() for r in range(len(packed))]
        assert len(alone) == args.records, (len(alone), args.records)
        used = sum(int(hi) - int(lo) for lo, hi in packed.arrays["doc_bounds"])
        runs = {"packed": timed(model, batches, args.repeats, args.device),
                "one per row": timed(model, alone, args.repeats, args.device)}
        seconds = {k: v[0] for k, v in runs.items()}
        (packed_ce, alone_ce) = runs["packed"][1], runs["one per row"][1]
        per_doc, whole = rope_cost(model, packed, token)
        print(f"[vlm_packing] {args.size} seq_len {args.seq_len}: {args.records} conversations ({used} tokens) -> "
              f"{len(batches)} packed rows, padding {1 - used / (len(batches) * args.seq_len):.1%}"
              f" vs {len(alone)} rows one per row, padding {1 - used / (len(alone) * args.seq_len):.1%}")
        rates = {k: args.records / v for k, v in seconds.items()}
        print(f"[vlm_packing] forward+backward: packed {rates['packed']:.1f} conversations/s, one per row "
              f"{rates['one per row']:.1f} conversations/s: x{rates['packed'] / rates['one per row']:.2f}")
        print(f"[vlm_packing] summed loss over every target: packed {packed_ce:.6f}, one per row {alone_ce:.6f}, "
              f"relative difference {abs(packed_ce - alone_ce) / abs(alone_ce):.1e} ({args.attention}, {args.device})")
        print(f"[vlm_packing] positions per packed row: per conversation {per_doc * 1e3:.2f} ms, one get_rope_index "
              f"over the row {whole * 1e3:.2f} ms (x{per_doc / whole:.1f}); {per_doc * len(batches) / seconds['packed']:.1%}"
              " of the packed forward+backward")
        return 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
