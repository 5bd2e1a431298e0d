"""Gemma 3 packed rows (harness/model/vision_masks.py) under each attention implementation that can take them: a
packed row's loss and every gradient against the same conversations one per row, fp32, one process.

    python bench/vlm_gemma_packing.py [--device cpu|cuda] [--attention sdpa eager flex_attention] [--seq-len 400]

The tiny random Gemma 3 of tests/helpers/vl_models.py (one sliding and one full-attention layer, window 32) and a
chat JSONL of text-only, one-image and two-image conversations; the vision store's first packed row
(train.packing=document) against its conversations one per row (train.packing=concat, seq_len 96: one each). The
check for flex_attention's BlockMask on a GPU (flex has no backward on CPU): bench/gpu_check.sh's vlm_packing case.
Prints the worst difference relative to the value (loss and every gradient), and exits 1 past --tol.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
KINDS = ["text", "image", "two", "text", "image", "text", "two", "image"]


def rows(folder: str, data: str, seq_len: int, store: Path, packing: str):
    from harness.model.hf import load_tokenizer
    from harness.train.vision_steps import load_data

    recipe = {"train": {"model": folder, "dataset": data, "format": "chat", "seq_len": seq_len,
                        "store_dir": str(store), "eval_fraction": 0, "seed": 0, "messages_field": "messages",
                        "packing": packing}}
    return load_data(SimpleNamespace(recipe=recipe), SimpleNamespace(local_rank=0), load_tokenizer(folder))[0]


def loss_and_grads(model, batch, device: str):
    from harness.data.rows import loss_items

    model.zero_grad(set_to_none=True)
    ids, labels, images, *positions = batch
    images.pixels = [p.to(device) for p in images.pixels]
    loss = model(input_ids=ids.to(device), labels=labels.to(device), images=images, num_calls=len(images),
                 per_call=1, use_cache=False, position_ids=positions[0].to(device) if positions else None,
                 num_items_in_batch=loss_items(labels)).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _worst(got, want) -> float:
    return float((got - want).abs().max()) / max(1.0, float(want.abs().max()))


def main(argv=None) -> int:
    import torch
    from transformers import AutoModelForImageTextToText

    from harness.model import vision
    from helpers.vl_models import gemma3_folder, write_chat, write_images

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--attention", nargs="+", default=["sdpa", "eager"])
    parser.add_argument("--seq-len", type=int, default=400)
    parser.add_argument("--tol", type=float, default=1e-6)
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="bench_vlm_gemma_"))
    try:
        folder = gemma3_folder(root / "gemma")
        data = write_chat(root / "data" / "chat.jsonl", write_images(root / "data" / "img", 5), KINDS)
        packed = rows(folder, data, args.seq_len, root / "packed", "document")[0:1]
        alone = rows(folder, data, 96, root / "alone", "concat")[0:len(packed.records)]
        failed = 0
        for attention in args.attention:
            model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32,
                                                                attn_implementation=attention).to(args.device)
            vision.install(model)
            loss, grads = loss_and_grads(model, packed.tensors(), args.device)
            want, want_grads = loss_and_grads(model, alone.tensors(), args.device)
            worst = max([_worst(loss, want)] + [_worst(grads[n], g) for n, g in want_grads.items()])
            failed += worst > args.tol or set(grads) != set(want_grads)
            print(f"[vlm_gemma_packing] {attention} ({args.device}): {len(packed.records)} conversations in one row of "
                  f"{args.seq_len}: loss {float(loss):.7f} vs {float(want):.7f} one per row; worst relative "
                  f"difference over the loss and {len(want_grads)} grads {worst:.2e} (tol {args.tol:g})")
        return 1 if failed else 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
