"""A mixture of sources (train.datasets): what each source is, the checks made before any rank trains, and the
rows of every source's own token store behind one blend (harness/data/blend.py, mix_rows.py).

A source is a train.dataset in one of the formats (text, instruction, chat, sharegpt, alpaca) with its fields, a
weight and a name; its store is the one `train.dataset` of the same source, format and fields would use (keyed
the same way), so every mixture that names a source shares its store. A source may also name a prepared store
folder (meta.json inside): it is used as is once its tokenizer and seq_len are the run's.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from harness.data.blend import Blend, cached_pattern
from harness.config.mixture_rules import PAIRS_FORMAT, derived_name
from harness.data.corpus import DataSpec
from harness.errors import Problem, UsageError

# a source's keys beside dataset, weight and name; missing ones default to the train block's
SOURCE_FIELDS = ("dataset_config", "dataset_split", "format", "text_field", "prompt_field", "response_field",
                 "messages_field", "conversations_field", "instruction_field", "input_field", "output_field")


@dataclass(frozen=True)
class Source:
    name: str
    spec: DataSpec
    weight: float
    path: str  # the JSON path of its entry, for messages: train.datasets[i]


def sources(train: dict) -> list[Source] | None:
    """The mixture's sources, or None for the one-source form (train.dataset)."""
    entries = train.get("datasets") or []
    if not entries:
        return None
    out = []
    for i, entry in enumerate(entries):
        merged = {**train, **{k: entry[k] for k in SOURCE_FIELDS if k in entry}, "dataset": entry["dataset"]}
        spec = DataSpec.from_train(merged)
        out.append(Source(entry.get("name") or derived_name(entry["dataset"]), spec, float(entry["weight"]),
                          f"train.datasets[{i}]"))
    return out


def problems(recipe: dict, load_tokenizer) -> list[Problem]:
    """Each local source's files (the path exists, its head holds the records and columns its format reads: file
    and line), and a prepared store's tokenizer and seq_len (the run's; load_tokenizer(model) reads the run's).
    Names and formats: config/mixture_rules."""
    from harness.data.files import check_local

    train = recipe["train"]
    found = sources(train)
    if found is None or train.get("objective", "lm") != "lm":
        return []
    out = []
    for src in found:
        if src.spec.format == PAIRS_FORMAT:
            continue
        try:
            if _prepared_store(src.spec.dataset) is not None:
                prepared_source(src, load_tokenizer(train["model"]), train["seq_len"])
            else:
                try:
                    check_local(src.spec)
                except UsageError as e:  # its fix names train.KEY: here the source's own key
                    raise UsageError(str(e).replace("train.", f"{src.path}.")) from None
        except UsageError as e:
            why, _, fix = str(e).partition("\n    fix: ")
            out.append(Problem(f"{src.path}.dataset", why, fix))
    return out


def _prepared_store(dataset: str) -> Path | None:
    path = Path(dataset).expanduser()
    return path if (path / "meta.json").is_file() and (path / "tokens.bin").is_file() else None


def prepared_source(src: Source, tokenizer, seq_len: int):
    """A source that names a prepared store folder: its Store, refused (exit 2) if its tokenizer or seq_len is not
    the run's. None for any other source."""
    from harness.data.store import open_store, tokenizer_hash

    path = _prepared_store(src.spec.dataset)
    if path is None:
        return None
    meta = json.loads((path / "meta.json").read_text())
    key = meta.get("key", {})
    want = tokenizer_hash(tokenizer, key.get("format") in ("chat", "sharegpt"))
    if key.get("tokenizer_hash") != want:
        raise UsageError(f"{src.path}.dataset {str(path)!r}: the store was tokenized with another tokenizer (hash "
                         f"{str(key.get('tokenizer_hash'))[:12]}) than this run's {getattr(tokenizer, 'name_or_path', '')!r}"
                         f" (hash {want[:12]}); its token ids would mean other text\n    fix: point "
                         f"{src.path}.dataset at the source files (the run tokenizes them once), or prepare the "
                         "store with this model: harness data prepare --model MODEL")
    if key.get("seq_len") != seq_len:
        raise UsageError(f"{src.path}.dataset {str(path)!r}: the store was packed for seq_len={key.get('seq_len')}, "
                         f"the run trains seq_len={seq_len}\n    fix: set train.seq_len={key.get('seq_len')} or "
                         "point the source at its files")
    store = open_store(path, key)
    if store is None:
        raise UsageError(f"{src.path}.dataset {str(path)!r}: the store is incomplete or damaged\n    fix: prepare "
                         "it again (harness data prepare) or point the source at its files")
    return store


class Mixture:
    """The sources of a run, their training and eval rows, and the blend they are read by."""

    def __init__(self, names: list[str], weights: list[float], blend: Blend, stores: list):
        self.names, self.weights, self.blend, self.stores = names, weights, blend, stores

    def client_state(self) -> dict:
        return {"blend": self.blend.state(), "blend_sources": list(self.names)}

    def resumed(self, client: dict, position: int) -> tuple["Mixture", str | None]:
        """This mixture continued from a checkpoint's blend at `position` (rows read); a note when the weights
        changed. A checkpoint of another set of sources is refused."""
        if "blend" not in client:
            raise UsageError("the checkpoint was saved by a run of one source (train.dataset); this run reads a "
                             "mixture (train.datasets)\n    fix: resume with the checkpoint's data, or start afresh")
        if list(client["blend_sources"]) != self.names:
            raise UsageError(f"the checkpoint's mixture reads sources {client['blend_sources']}, this run "
                             f"{self.names}\n    fix: resume with the same sources in the same order (weights may "
                             "change), or start afresh")
        saved = Blend.from_state(client["blend"], self.blend.rounded)
        blend = saved.reweighted(position, self.weights)
        if blend is saved:
            return Mixture(self.names, self.weights, saved, self.stores), None
        counts = saved.counts(position)
        old = saved.segments[-1].weights
        before = ", ".join(f"{n} {o / sum(old):.3g} -> {w / sum(self.weights):.3g}"
                           for n, o, w in zip(self.names, old, self.weights))
        read = ", ".join(f"{n} {int(c)}" for n, c in zip(self.names, counts))
        return Mixture(self.names, self.weights, blend, self.stores), (
            f"weights changed at row {position}: {before}; rows read so far are kept ({read}) and the new weights "
            "hold from this step on")


def blend_key(srcs: list[Source], stores: list, weights, seed: int, seq_len: int) -> dict:
    return {"sources": [[s.name, str(st.path)] for s, st in zip(srcs, stores)], "weights": list(weights),
            "seed": seed, "seq_len": seq_len}


def cached_blend(key: dict, root: str | None) -> tuple[Blend, bool]:
    """(the blend of key's weights, whether its pattern came from the cache): the pattern of one period is kept
    under ROOT/blends as a .npy named by the key (2 bytes per position), so a launch reads it."""
    from harness.data.store import DEFAULT_ROOT

    blend = Blend.of(key["weights"])
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    found = cached_pattern(blend.segments[0].weights, Path(root or DEFAULT_ROOT).expanduser() / "blends" / f"{digest}.npy")
    return blend, found


def load(train: dict, local_rank: int, tokenizer) -> tuple[Mixture, object, object, list[str]]:
    """(the mixture, its training rows, its eval rows, start-up lines): each source's store (prepared here once
    if missing, as for train.dataset), split into train and eval by train.eval_fraction and train.seed."""
    from harness.data.formats import check_chat_template
    from harness.data.mix_rows import MixRows
    from harness.data.rows import Rows, split_rows
    from harness.data.store import empty_rows_note, ensure_store

    srcs = sources(train)
    for src in srcs:  # every rank, so all exit with the message before any waits on a store
        if src.spec.uses_chat_template:
            check_chat_template(tokenizer, train["model"], src.spec.format)
    stores, trains, evals, lines = [], [], [], []
    for src in srcs:
        store = prepared_source(src, tokenizer, train["seq_len"])
        made = False
        if store is None:
            store, made = ensure_store(src.spec, tokenizer, train["seq_len"], train["store_dir"] or None, local_rank)
        rows_train, rows_eval = split_rows(Rows.of(store, train["packing"]), train["eval_fraction"], train["seed"])
        stores.append(store)
        trains.append(rows_train)
        evals.append(rows_eval)
        meta = store.meta
        lines.append(f"source {src.name} (weight {src.weight:g}, {meta['format']}): {'prepared' if made else 'using'} "
                     f"store {store.path}: {meta['documents']} documents, {meta['tokens']} tokens, "
                     f"{len(rows_train)} train / {len(rows_eval)} eval rows")
        if note := empty_rows_note(meta):
            lines.append(f"warning: source {src.name}: {note}")
    names, weights = [s.name for s in srcs], [s.weight for s in srcs]
    blend, cached = cached_blend(blend_key(srcs, stores, weights, train["seed"], train["seq_len"]),
                                 train["store_dir"] or None)
    period = sum(blend.segments[0].weights)
    lines.append(f"blend of {len(srcs)} sources: a pattern of {period} rows ({'read from the cache' if cached else 'built'}"
                 f"){'; weights rounded to millionths' if blend.rounded else ''}")
    mix = Mixture(names, weights, blend, stores)
    return mix, MixRows(trains, names), MixRows(evals, names), lines


def epoch_lines(mix: Mixture, sizes: list[int], eval_sizes: list[int], global_batch: int, start_step: int,
                steps: int) -> tuple[list[str], dict]:
    """(start-up lines, the run's `mixture` record): how many epochs of each source the run reads (from start_step
    to steps), and the steps to one epoch of the source that runs out first."""
    counts = mix.blend.counts(steps * global_batch) - mix.blend.counts(start_step * global_batch)
    shares = np.asarray(mix.weights, dtype=np.float64) / sum(mix.weights)
    parts = ", ".join(f"{n} {c / size:.2f} ({int(c)} of {size} rows)" for n, c, size in zip(mix.names, counts, sizes))
    first = int(np.argmin(np.asarray(sizes) / shares))
    one = int(np.ceil(sizes[first] / shares[first] / global_batch))
    first_out = f"{mix.names[first]} runs out first: one epoch of it every {one} steps"
    record = {"period": int(sum(mix.blend.segments[-1].weights)), "first_out": first_out, "steps_per_epoch": one,
              "sources": [{"name": n, "weight": w, "train_rows": int(size), "eval_rows": int(ev),
                           "store": str(store.path), "epochs": float(c / size)}
                          for n, w, size, ev, store, c in zip(mix.names, mix.weights, sizes, eval_sizes, mix.stores,
                                                              counts)]}
    return [f"epochs over steps {start_step + 1}..{steps}: {parts}; {first_out}"], record


def _known_rows(src: Source, tokenizer, train: dict) -> tuple[int, int] | None:
    """(training rows, tokens) of a source whose store exists (prepared earlier or by a run), else None."""
    from harness.data.store import open_store, store_key, store_path

    try:
        store = prepared_source(src, tokenizer, train["seq_len"])
        if store is None:
            key = store_key(src.spec, tokenizer, train["seq_len"])
            store = open_store(store_path(key, train.get("store_dir") or None), key)
    except (UsageError, OSError, ValueError):
        return None
    if store is None:
        return None
    eval_rows = max(1, round(store.num_rows * train["eval_fraction"])) if train["eval_fraction"] > 0 else 0
    return store.num_rows - eval_rows, int(store.meta["tokens"])


def plan_lines(train: dict, global_batch: int, steps: int | None, tokenizer) -> tuple[list[str], dict]:
    """What `harness plan` and `--recipe auto` say about a mixture, from the sources' stores where they exist:
    each source's rows and tokens, its epochs over `steps` and the steps to one epoch of the source that runs out
    first. A source with no store yet is named unknown (`harness data prepare` makes it); so is every source when
    the run's tokenizer is not at hand (tokenizer None: a hub model offline)."""
    srcs = sources(train) or []
    total = sum(s.weight for s in srcs)
    out, lines, first = [], [], None
    for src in srcs:
        known = _known_rows(src, tokenizer, train) if tokenizer is not None else None
        share = src.weight / total
        row = {"name": src.name, "weight": src.weight, "share": share, "train_rows": None, "tokens": None,
               "epochs": None, "steps_per_epoch": None}
        if known is not None:
            rows, tokens = known
            per_epoch = rows / share / global_batch
            row.update(train_rows=rows, tokens=tokens, steps_per_epoch=per_epoch,
                       epochs=steps * global_batch * share / rows if steps else None)
            if first is None or per_epoch < first["steps_per_epoch"]:
                first = row
        out.append(row)
        what = (f"{known[1]:,} tokens, {known[0]:,} train rows"
                + (f", {row['epochs']:.2f} epochs over {steps} steps" if steps else "")
                if known else "no store yet: unknown (harness data prepare --set train.datasets=... makes it)")
        lines.append(f"  {src.name} (weight {src.weight:g} = {share:.1%}): {what}")
    head = f"data: mixture of {len(srcs)} sources, {global_batch} rows of {train['seq_len']} tokens per step"
    if first is not None:
        head += f"; {first['name']} runs out first: one epoch of it every {first['steps_per_epoch']:.0f} steps"
    return [head, *lines], {"global_batch": global_batch, "steps": steps, "sources": out,
                            "first_out": first and first["name"]}
