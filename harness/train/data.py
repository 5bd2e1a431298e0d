"""Text data: load a corpus (built-in, local files, or a hub id), tokenise it, pack it into fixed blocks.

Packing (documents joined with eos, cut into seq_len blocks, remainder dropped) gives every row the same
length, so a row index is all a rank needs to know what it trains on (see harness.train.batches).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from harness.errors import UsageError

BUILTIN = "builtin"
BUILTIN_CORPUS = Path(__file__).resolve().parent.parent / "assets" / "corpus.jsonl"
# datasets builder per file extension
BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
DEFAULT_CACHE_DIR = "~/.cache/dsharness"
PACK_FORMAT_VERSION = 1  # bump when the packing rule changes, so old caches are not reused


def _supported() -> str:
    return ", ".join(BUILDERS)


def _builder_for(path: Path) -> str:
    builder = BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise UsageError(f"unsupported data file {path}: extension {path.suffix or '(none)'!r}\n"
                         f"    fix: use one of {_supported()} (or a hub dataset id)")
    return builder


def _files_in(folder: Path) -> tuple[str, list[str]]:
    """The builder and sorted files of a folder; all supported files must share one builder."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in BUILDERS)
    if not files:
        raise UsageError(f"data folder {folder} has no data files\n    fix: add files ending in {_supported()}")
    builders = {BUILDERS[p.suffix.lower()] for p in files}
    if len(builders) > 1:
        raise UsageError(f"data folder {folder} mixes file kinds ({', '.join(sorted(builders))})\n"
                         "    fix: keep one kind of file per folder, or point at a single file")
    return builders.pop(), [str(p) for p in files]


def _looks_like_path(spec: str) -> bool:
    return spec.startswith((".", "/", "~")) or Path(spec).suffix.lower() in BUILDERS


def local_source(spec: str) -> tuple[str, str | list[str]] | None:
    """(datasets builder, data_files) of builtin or a local file or folder; None for a hub id. Reads no data,
    so it runs before any rank trains; raises UsageError for a missing path or files it cannot read."""
    if spec == BUILTIN:
        return "json", str(BUILTIN_CORPUS)
    path = Path(spec).expanduser()
    if path.is_dir():
        return _files_in(path)
    if path.is_file():
        return _builder_for(path), str(path)
    if _looks_like_path(spec):
        raise UsageError(f"data file {spec} does not exist\n    fix: check the path, or use {BUILTIN!r}")
    return None


def _load_raw(spec: str):
    """datasets.Dataset (train split) for a spec, before column checks."""
    import datasets

    local = local_source(spec)
    if local is not None:
        return datasets.load_dataset(local[0], data_files=local[1], split="train")
    try:
        return datasets.load_dataset(spec, split="train")
    except Exception as err:  # datasets raises many types (ConnectionError, DatasetNotFoundError, ...)
        first = str(err).splitlines()[0] if str(err) else ""
        raise UsageError(
            f"cannot load dataset {spec!r}: not {BUILTIN!r}, not a local file or folder, and the Hugging Face "
            f"Hub lookup failed ({type(err).__name__}: {first})\n    fix: use {BUILTIN!r} or a local file "
            f"({_supported()}); with network unset HF_DATASETS_OFFLINE/HF_HUB_OFFLINE and check the id"
        ) from None


def load_text_dataset(spec: str, text_field: str = "text"):
    """A datasets.Dataset with exactly one column, "text", from `spec`'s `text_field` column."""
    ds = _load_raw(spec)
    if text_field not in ds.column_names:
        raise UsageError(f"dataset {spec!r} has no column {text_field!r}; its columns are: "
                         f"{', '.join(ds.column_names)}\n    fix: pass the text column's name as text_field")
    ds = ds.select_columns([text_field])
    if text_field != "text":
        ds = ds.rename_column(text_field, "text")
    return ds


def _tokenizer_key(tokenizer) -> str:
    """What the packed ids depend on: the tokenizer's full definition and its eos id."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        body = backend.to_str()
    else:
        from datasets.fingerprint import Hasher

        body = Hasher.hash(tokenizer)
    return f"{type(tokenizer).__name__}:{tokenizer.eos_token_id}:{body}"


def pack_cache_path(ds, tokenizer, seq_len: int, cache_dir: str | None) -> Path | None:
    """Where the packed blocks of (ds, tokenizer, seq_len) are cached; None when ds has no stable identity.

    A file-backed dataset's fingerprint is derived from its source files, so it is the same in every
    process; an in-memory dataset's is not, and caching it would only leave litter behind.
    """
    if not ds.cache_files:
        return None
    key = hashlib.sha256(
        f"{PACK_FORMAT_VERSION}|{ds._fingerprint}|{seq_len}|{_tokenizer_key(tokenizer)}".encode()
    ).hexdigest()[:24]
    return Path(cache_dir or DEFAULT_CACHE_DIR).expanduser() / "packed" / f"blocks_{seq_len}_{key}.pt"


def _tokenize_flat(ds, tokenizer, num_proc):
    """All documents' token ids, each followed by eos, as one 1-D int64 tensor."""
    import pyarrow.compute as pc
    import torch

    eos = tokenizer.eos_token_id
    if eos is None:
        raise UsageError("the tokenizer has no eos token\n    fix: use a tokenizer with an eos token; "
                         "packing needs it to mark where each document ends")

    def encode(batch):
        texts = [t or "" for t in batch["text"]]
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        return {"input_ids": [row + [eos] if row else [] for row in ids]}

    tokenized = ds.map(encode, batched=True, remove_columns=ds.column_names, num_proc=num_proc,
                       desc="tokenize")
    column = tokenized.with_format("arrow")[:]["input_ids"]
    return torch.from_numpy(pc.list_flatten(column).to_numpy().astype("int64"))


def tokenize_and_pack(ds, tokenizer, seq_len: int, cache_dir: str | None = None, num_proc=None):
    """torch.LongTensor [num_blocks, seq_len]: documents joined with eos, cut into blocks, tail dropped.

    num_proc defaults to None (no fork): under deepspeed every rank already occupies cores.
    """
    import torch

    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    cache = pack_cache_path(ds, tokenizer, seq_len, cache_dir)
    if cache is not None and cache.is_file():
        return torch.load(cache, weights_only=True)
    flat = _tokenize_flat(ds, tokenizer, num_proc)
    num_blocks = flat.numel() // seq_len
    if num_blocks == 0:
        raise UsageError(f"the dataset has {flat.numel()} tokens, fewer than one block of seq_len={seq_len}\n"
                         "    fix: use more text or a smaller seq_len")
    blocks = flat[: num_blocks * seq_len].view(num_blocks, seq_len).contiguous()
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".tmp{os.getpid()}")
        torch.save(blocks, tmp)
        os.replace(tmp, cache)  # atomic: ranks packing at once never read a half-written file
    return blocks


def split_blocks(blocks, eval_fraction: float, seed: int):
    """(train_blocks, eval_blocks): a seeded random choice of eval rows, at least one when fraction > 0.

    Both keep the original row order, so eval rows are whole, contiguous-text blocks like train rows.
    """
    import torch

    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    num_rows = blocks.shape[0]
    num_eval = max(1, round(num_rows * eval_fraction)) if eval_fraction > 0 else 0
    if num_eval >= num_rows:
        raise ValueError(f"eval_fraction={eval_fraction} of {num_rows} blocks leaves no training blocks; "
                         "use a smaller eval_fraction or more data")
    perm = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed))
    eval_idx, _ = torch.sort(perm[:num_eval])
    train_idx, _ = torch.sort(perm[num_eval:])
    return blocks[train_idx], blocks[eval_idx]
