"""`harness data prepare --dataset SPEC --model M --seq-len N`: tokenize a corpus once into the token store
that runs with the same train.* keys then memory-map (a run prepares it itself when it is missing; doing it
here first keeps tokenization out of the launch). Other train.* keys (format, fields, hub config and split)
come through --set, exactly as for a run.
"""

from __future__ import annotations

import argparse

from harness.errors import UsageError
from harness.data.corpus import FORMATS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    p = sub.add_parser("prepare", help="tokenize a dataset into a prepared token store")
    p.add_argument("--dataset", help="builtin, a local file or folder, or a hub id (train.dataset)")
    p.add_argument("--model", help="model whose tokenizer to use (train.model)")
    p.add_argument("--seq-len", type=int, help="tokens per packed row (train.seq_len)")
    p.add_argument("--format", choices=FORMATS, help="train.format")
    p.add_argument("--num-proc", type=int, default=None, help="tokenizing processes (default: one per core)")
    p.add_argument("--out", help="store folder root (train.store_dir; default ~/.cache/dsharness/stores)")
    p.add_argument("--stream", action="store_true", help="stream the dataset instead of loading it first")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="any other recipe key, e.g. --set train.dataset_split=validation")


def _recipe(args) -> dict:
    from harness.config.recipes import complete

    flags = {"dataset": args.dataset, "model": args.model, "seq_len": args.seq_len, "format": args.format,
             "store_dir": args.out}
    sets = [f"train.{k}={v}" for k, v in flags.items() if v is not None]
    return complete({"description": "harness data prepare"}, "harness data prepare", [*args.overrides, *sets])


def _prepare_pairs(spec, tokenizer, train: dict, truncation: str, num_proc: int | None) -> int:
    """--set train.objective=dpo (ipo, simpo, orpo): the preference store the run will read."""
    from harness.data.preference import notes
    from harness.data.preference_store import prepare_pairs

    store, made = prepare_pairs(spec, tokenizer, train["seq_len"], truncation, train["store_dir"] or None, num_proc)
    meta = store["meta"]
    how = f"prepared in {meta['prepared_s']:.1f}s" if made else "already prepared"
    print(f"[data] {store['path']}: {how}")
    for line in notes(meta, truncation):
        print(f"[data] {line}")
    return 0


def _prepare_shards(spec, tokenizer, train: dict, num_proc: int | None) -> int:
    """--set train.streaming=true: the shard store a streamed run reads, written to the end here (continuing from
    the shards a run's writer left)."""
    import time

    from harness.data.shards import stream_key, stream_path
    from harness.data.stream_writer import write_store

    start = time.perf_counter()
    key = stream_key(spec, tokenizer, train["seq_len"], train["stream_shard_tokens"])
    manifest = write_store(spec, tokenizer, key, stream_path(key, train["store_dir"] or None), num_proc)
    print(f"[data] {manifest['shards']} shards of {manifest['shard_rows']} rows: {manifest['rows']} rows of "
          f"{manifest['seq_len']}, {manifest['documents']} documents, {manifest['loss_tokens']} tokens carry loss "
          f"({time.perf_counter() - start:.1f}s)")
    return 0


def run(args: argparse.Namespace) -> int:
    from harness.data.corpus import DataSpec
    from harness.data.chat_check import check_chat_head
    from harness.data.formats import check_chat_template
    from harness.model.hf import load_tokenizer
    from harness.data.store import empty_rows_note, prepare

    if args.num_proc is not None and args.num_proc < 1:
        raise UsageError(f"--num-proc {args.num_proc}: must be >= 1\n    fix: leave it out for one per core")
    recipe = _recipe(args)
    train = recipe["train"]
    spec, tokenizer = DataSpec.from_train(train), load_tokenizer(train["model"])
    if spec.preference:
        return _prepare_pairs(spec, tokenizer, train, recipe["preference"]["truncation"], args.num_proc)
    if spec.uses_chat_template:
        check_chat_template(tokenizer, train["model"], spec.format)
        checked, split = check_chat_head(spec, tokenizer)  # a record the template cannot train: file and line
        if split:
            print(f"[data] the chat template rewrites history in {split} of the first {checked} records: their "
                  f"assistant turns train in more than one sample (train.chat_turns={spec.chat_turns})")
    if train["streaming"]:
        return _prepare_shards(spec, tokenizer, train, args.num_proc)
    store, made = prepare(spec, tokenizer, train["seq_len"], train["store_dir"] or None,
                          num_proc=args.num_proc, streaming=True if args.stream else None)
    meta = store.meta
    how = f"prepared in {meta['prepared_s']:.1f}s with {meta['num_proc']} processes" if made else "already prepared"
    print(f"[data] {store.path}: {how}")
    print(f"[data] {meta['documents']} documents, {meta['tokens']} tokens ({meta['dtype']}), {meta['rows']} rows "
          f"of {meta['seq_len']}, format {meta['format']}, {meta['loss_tokens']} tokens carry loss")
    if note := empty_rows_note(meta):
        print(f"[data] warning: {note}")
    if train["store_dir"]:
        print(f"[data] train with --set train.store_dir={train['store_dir']} to use it")
    return 0
