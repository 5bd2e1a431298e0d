"""The store of a vision-language run: tokens and preprocessed images, written once, memory-mapped by every rank.

One folder per (data source, tokenizer + chat template, image processor, model family, seq_len), named by a hash:
    tokens.npy   int32 [rows, seq_len]  whole conversations packed in record order, right-padded (harness/data/
                                        vision_pack.py: a conversation, and so every image span, never crosses rows)
    mask.npy     uint8 [rows, seq_len]  1 on assistant tokens (the loss), 0 on prompts, image tokens and padding
    row_docs.npy int64 [rows + 1]       row r holds conversations row_docs[r]:row_docs[r + 1]
    doc_bounds.npy int64 [convs, 2]     each conversation's [start, end) in its row
    row_images.npy int64 [rows + 1]     row r's images are images[row_images[r]:row_images[r + 1]], in span order
    pixel_offsets.npy int64 [images + 1] element offsets into pixels.npy
    pixel_shapes.npy  int64 [images, 4]  each image's preprocessed shape (leading dim concatenated per call)
    grids.npy    int64 [images, 3]      [t, h, w] per image (Qwen-VL), zeros otherwise
    kinds.npy    int8 [images]          1 an image, 2 a video (harness/data/video.py: frames grouped in time)
    seconds.npy  float64 [images]       a video's seconds per temporal patch (Qwen2.5-VL's time positions), else 0
    pixels.npy   float32 [elements]     every image's pixel values back to back
    records.npy  int64 [convs]          the record each conversation came from (for messages)
    meta.json    the key and counts; written last, the folder renamed into place when complete.
The store is the same for both train.packing values; VisionRows gives document positions under `document`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from harness.data.rows import IGNORE_INDEX
from harness.data.video import DEFAULTS as VIDEO_DEFAULTS
from harness.data.vision import encode
from harness.errors import UsageError

VERSION = 3  # 2: packed rows (row_docs, doc_bounds; records per conversation); 3: kinds and seconds (videos)
ARRAYS = ("tokens", "mask", "row_images", "row_docs", "doc_bounds", "pixel_offsets", "pixel_shapes", "grids", "pixels",
          "records", "kinds", "seconds")


def _records(spec):
    """(source name, base folder for relative image paths, iterable of (number, record))."""
    from harness.data.corpus import load_raw, local_source

    local = local_source(spec.dataset)
    if local is not None and all(f.endswith((".json", ".jsonl")) for f in local[1]):
        def read():
            number = 0
            for name in local[1]:
                text = Path(name).read_text()
                rows = json.loads(text) if name.endswith(".json") else \
                    [json.loads(line) for line in text.splitlines() if line.strip()]
                for row in rows:
                    number += 1
                    yield number, row
        return spec.dataset, Path(local[1][0]).parent, read()
    return spec.dataset, Path.cwd(), enumerate(load_raw(spec), start=1)  # every column: the images one too


@dataclass
class Context:
    tokenizer: object
    image_processor: object
    config: object
    grid: bool
    image_token: int
    field: str
    base: Path
    source: str
    video_defaults: dict = field(default_factory=lambda: dict(VIDEO_DEFAULTS))  # video.defaults_of(model folder)


def store_key(spec, tokenizer, image_processor, config, seq_len: int, video_defaults: dict | None = None) -> dict:
    from harness.data.corpus import source_fingerprint
    from harness.data.store import tokenizer_hash
    from harness.planner.vision import family_of

    processor = hashlib.sha256(image_processor.to_json_string().encode()).hexdigest()
    return {"version": VERSION, "kind": "vision", "dataset": spec.dataset, "fingerprint": source_fingerprint(spec),
            "field": spec.messages_field, "tokenizer_hash": tokenizer_hash(tokenizer, True),
            "image_processor": processor, "family": family_of(config.model_type).name, "seq_len": seq_len,
            "vision": config.vision_config.to_json_string(), "video_defaults": video_defaults or VIDEO_DEFAULTS}


def _write(tmp: Path, spec, ctx: Context, seq_len: int) -> dict:
    from harness.data.vision_pack import Packer, fit

    source, base, records = _records(spec)
    ctx.source, ctx.base = source, base
    packer, offsets, shapes, grids, pixels, numbers = Packer(seq_len, ctx.tokenizer.pad_token_id), [0], [], [], [], []
    kinds, seconds = [], []
    truncated = with_images = 0
    for number, record in records:
        spans = (ctx.image_token, getattr(ctx.config, "video_token_id", None) or ctx.image_token)  # a video's alike
        enc, cut = fit(encode(record, number, ctx), seq_len, spans, f"{source} record {number}")
        packer.add(enc)
        numbers.append(number)
        for i, pix in enumerate(enc.pixels):
            pixels.append(pix.reshape(-1))
            offsets.append(offsets[-1] + pix.size)
            shapes.append(list(pix.shape) + [1] * (4 - pix.ndim))
            grids.append(enc.grids[i] if enc.grids else [0, 0, 0])
            kinds.append(enc.kinds[i] if enc.kinds else 1)
            seconds.append(enc.seconds[i] if enc.seconds else 0.0)
        truncated, with_images = truncated + cut, with_images + bool(enc.pixels)
    if not numbers:
        raise UsageError(f"{source}: no records\n    fix: point train.dataset at a file with chat records")
    arrays = {**packer.arrays(), "pixel_offsets": np.asarray(offsets),
              "pixel_shapes": np.asarray(shapes, dtype=np.int64).reshape(-1, 4),
              "grids": np.asarray(grids, dtype=np.int64).reshape(-1, 3),
              "pixels": np.concatenate(pixels) if pixels else np.zeros(0, np.float32),
              "records": np.asarray(numbers, dtype=np.int64), "kinds": np.asarray(kinds, dtype=np.int8),
              "seconds": np.asarray(seconds, dtype=np.float64)}
    for name, value in arrays.items():
        np.save(tmp / f"{name}.npy", value)
    return {"rows": len(arrays["tokens"]), "conversations": len(numbers), "with_images": with_images,
            "images": len(shapes), "truncated": truncated, "videos": int((arrays["kinds"] == 2).sum()),
            "pixel_bytes": int(arrays["pixels"].nbytes), "seq_len": seq_len}


def _open(path: Path, key: dict) -> dict | None:
    meta = path / "meta.json"
    if not meta.is_file() or json.loads(meta.read_text()).get("key") != key:
        return None
    store = {name: np.load(path / f"{name}.npy", mmap_mode="r") for name in ARRAYS}
    return {**store, "meta": json.loads(meta.read_text()), "path": path}


def prepare(spec, ctx: Context, seq_len: int, root: str | None, key: dict) -> tuple[dict, bool]:
    from harness.data.store import DEFAULT_ROOT

    path = Path(root or DEFAULT_ROOT).expanduser() / f"vision-{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]}"
    if (found := _open(path, key)) is not None:
        return found, False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        meta = _write(tmp, spec, ctx, seq_len)
        (tmp / "meta.json").write_text(json.dumps({"key": key, **meta}, indent=2) + "\n")
        if path.exists():
            shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _open(path, key), True


def ensure(spec, ctx: Context, seq_len: int, root: str | None, local_rank: int, poll_s: float = 0.2):
    """Local rank 0 prepares the store if it is missing; the node's other ranks wait for it on the file system."""
    key = store_key(spec, ctx.tokenizer, ctx.image_processor, ctx.config, seq_len, ctx.video_defaults)
    if local_rank == 0:
        return prepare(spec, ctx, seq_len, root, key)
    from harness.data.store import DEFAULT_ROOT

    path = Path(root or DEFAULT_ROOT).expanduser() / f"vision-{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]}"
    while (found := _open(path, key)) is None:
        time.sleep(poll_s)
    return found, False


class VisionRows:
    """A view (index array) over the store that quacks like harness/data/rows.Rows: shape, len, [sel], and
    tensors() -> (input_ids, labels, Images[, position_ids]), labels IGNORE_INDEX off the assistant turns; position
    ids restarting per conversation under train.packing=document (harness/data/vision_pack.py)."""

    def __init__(self, store: dict, index: np.ndarray, packing: str = "document"):
        self.arrays, self.index = store, index  # not `.store`: a streamed run's rows have one (job.py reads it)
        self.packing = packing

    @classmethod
    def of(cls, store: dict, packing: str = "document") -> "VisionRows":
        return cls(store, np.arange(store["meta"]["rows"], dtype=np.int64), packing)

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self.index), self.arrays["meta"]["seq_len"])

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, sel) -> "VisionRows":
        if torch.is_tensor(sel):
            sel = sel.numpy()
        return VisionRows(self.arrays, self.index[sel], self.packing)

    @property
    def records(self) -> np.ndarray:
        """The records of the conversations in these rows, row by row."""
        docs = self.arrays["row_docs"]
        return np.concatenate([np.asarray(self.arrays["records"][docs[r]:docs[r + 1]]) for r in self.index] or
                              [np.zeros(0, np.int64)])

    def num_images(self) -> int:
        starts = self.arrays["row_images"]
        return int(sum(starts[r + 1] - starts[r] for r in self.index))

    def images(self):
        from harness.data.vision import Images

        s, pixels, grids, kinds, seconds = self.arrays, [], [], [], []
        for row in self.index:
            for i in range(int(s["row_images"][row]), int(s["row_images"][row + 1])):
                lo, hi = int(s["pixel_offsets"][i]), int(s["pixel_offsets"][i + 1])
                shape = [int(d) for d in s["pixel_shapes"][i] if True]
                flat = np.asarray(s["pixels"][lo:hi], dtype=np.float32)
                pixels.append(torch.from_numpy(flat.copy()).reshape(_shape(shape, hi - lo)))
                if s["grids"][i].any():
                    grids.append(torch.from_numpy(np.asarray(s["grids"][i], dtype=np.int64).copy()))
                kinds.append(int(s["kinds"][i]))
                seconds.append(float(s["seconds"][i]))
        return Images(pixels, grids, kinds, seconds)

    def tensors(self):
        ids = torch.from_numpy(np.asarray(self.arrays["tokens"][self.index], dtype=np.int64))
        keep = torch.from_numpy(np.asarray(self.arrays["mask"][self.index], dtype=bool))
        labels = ids.masked_fill(~keep, IGNORE_INDEX)
        if self.packing != "document":
            return ids, labels, self.images()
        from harness.data.vision_pack import document_tensors

        labels, positions = document_tensors(self.arrays, self.index, labels)
        return ids, labels, self.images(), positions


def _shape(padded: list[int], size: int) -> list[int]:
    """The stored 4-d shape back to the image's own rank (trailing 1s were padding) with the element count."""
    shape = list(padded)
    while len(shape) > 1 and shape[-1] == 1 and int(np.prod(shape[:-1])) == size:
        shape.pop()
    return shape
