"""Corpus loading: which dataset a recipe names (built-in, local files, or a hub id with config and split),
loaded with `datasets`, its columns checked for the data format, and a cheap fingerprint of its source.

Tokenizing and packing happen once, into a prepared token store (harness.data.store); training reads that.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from harness.config.defaults import PATH_PREFIXES
from harness.config.objectives import OBJECTIVES
from harness.errors import UsageError

BUILTIN = "builtin"
BUILTIN_CORPUS = Path(__file__).resolve().parent.parent / "assets" / "corpus.jsonl"
BUILTIN_PREFERENCE = BUILTIN_CORPUS.with_name("preference.jsonl")  # builtin under a preference objective
PAIR_COLUMNS = ("chosen", "rejected")  # a preference record's two completions (TRL's column names)
COMPLETION_COLUMN = "completion"  # a prompt-completion record's completion (TRL's column name; train.objective gkd)
# datasets builder per file extension
BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
FORMATS = ("text", "instruction", "chat", "sharegpt", "alpaca")
STREAM_BYTES = 20 * 2**30  # hub datasets larger than this (as the hub reports them) are streamed, not downloaded


@dataclass(frozen=True)
class DataSpec:
    """What to read and how to turn a record into tokens: the recipe's train.dataset* and field keys."""

    dataset: str = BUILTIN
    config: str = ""  # hub dataset configuration ("" = its default)
    split: str = "train"
    format: str = "text"  # text | instruction | chat
    text_field: str = "text"
    prompt_field: str = "prompt"
    response_field: str = "response"
    messages_field: str = "messages"
    conversations_field: str = "conversations"  # sharegpt
    instruction_field: str = "instruction"  # alpaca
    input_field: str = "input"  # alpaca, optional
    output_field: str = "output"  # alpaca
    objective: str = "lm"  # train.objective: anything else reads preference pairs (harness/data/preference.py)
    tools_field: str = "tools"  # chat: the record's tool schemas, passed to the chat template (optional column)
    chat_turns: str = "all"  # chat, sharegpt: which assistant turns carry loss (harness/data/chat_template.py)

    @classmethod
    def from_train(cls, train: dict) -> "DataSpec":
        return cls(dataset=train["dataset"], config=train.get("dataset_config", ""),
                   split=train.get("dataset_split", "train"), format=train.get("format", "text"),
                   text_field=train.get("text_field", "text"), prompt_field=train.get("prompt_field", "prompt"),
                   response_field=train.get("response_field", "response"),
                   messages_field=train.get("messages_field", "messages"),
                   conversations_field=train.get("conversations_field", "conversations"),
                   instruction_field=train.get("instruction_field", "instruction"),
                   input_field=train.get("input_field", "input"), output_field=train.get("output_field", "output"),
                   objective=train.get("objective", "lm"), tools_field=train.get("tools_field", "tools"),
                   chat_turns=train.get("chat_turns", "all"))

    @property
    def preference(self) -> bool:
        return OBJECTIVES[self.objective].data == "pairs"

    @property
    def completions(self) -> bool:
        """Prompt-completion records, one per row (harness/train/distill_data.py)."""
        return OBJECTIVES[self.objective].data == "completions"

    @property
    def builtin_pairs(self) -> bool:
        """builtin is the embedded preference set (a gkd run reads its prompt and chosen answer as the completion)."""
        return self.preference or self.completions

    @property
    def prompts(self) -> bool:
        """An RL run's prompt set (harness/rl/prompts.py): records with a prompt column."""
        return OBJECTIVES[self.objective].data == "prompts"

    def column_note(self, key: str) -> str:
        """Where a column's name comes from, for messages: the recipe key and format, or the objective."""
        if self.prompts:
            return f"train.{key}, objective {self.objective!r}: TRL's prompt column"
        if self.completions and key == "prompt_field":
            return f"train.{key}, objective {self.objective!r}: TRL's prompt column"
        if self.preference and key in PAIR_COLUMNS:
            return f"train.objective {self.objective!r}"
        if key == COMPLETION_COLUMN:
            return f"train.objective {self.objective!r}: TRL's completion column"
        return f"train.{key}, format {self.format!r}"

    def column_fix(self, key: str) -> str:
        if self.preference and key in PAIR_COLUMNS:
            return (f"name the column {key!r} (a preference record holds {' and '.join(PAIR_COLUMNS)}, and "
                    "train.prompt_field unless they are message lists that share the prompt)")
        if key == COMPLETION_COLUMN:
            return f"name the column {key!r} (a prompt-completion record holds train.prompt_field and {key!r})"
        return f"set train.{key} to the column that holds it"

    @property
    def columns(self) -> dict[str, str]:
        """{recipe key: column name} the format reads (a preference record: its two completions)."""
        if self.preference:
            return {key: key for key in PAIR_COLUMNS}
        if self.prompts:
            return {"prompt_field": self.prompt_field}
        if self.completions:
            return {"prompt_field": self.prompt_field, COMPLETION_COLUMN: COMPLETION_COLUMN}
        if self.format == "instruction":
            return {"prompt_field": self.prompt_field, "response_field": self.response_field}
        if self.format == "chat":
            return {"messages_field": self.messages_field}
        if self.format == "text":
            return {"text_field": self.text_field}
        if self.format == "sharegpt":
            return {"conversations_field": self.conversations_field}
        if self.format == "alpaca":
            return {"instruction_field": self.instruction_field, "output_field": self.output_field}
        raise UsageError(f"train.format {self.format!r} is not one of {', '.join(FORMATS)}\n"
                         f"    fix: set train.format to one of {', '.join(FORMATS)}")


    @property
    def uses_chat_template(self) -> bool:
        return self.format in ("chat", "sharegpt")

    @property
    def optional_columns(self) -> dict[str, str]:
        """{recipe key: column name} the format reads when the dataset has it."""
        if self.preference:
            return {"prompt_field": self.prompt_field}
        if self.format == "chat":
            return {"tools_field": self.tools_field}
        return {"input_field": self.input_field} if self.format == "alpaca" else {}

    @property
    def fields(self) -> dict[str, str]:
        """Every column the tokens depend on (the store key)."""
        return {**self.columns, **self.optional_columns}


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
    every = sorted(p for p in folder.rglob("*") if p.is_file())
    files = [p for p in every if p.suffix.lower() in BUILDERS]
    if not files:
        held = (f"holds {len(every)} other files ({', '.join(p.name for p in every[:5])}"
                f"{', ...' if len(every) > 5 else ''})" if every else "is empty")
        raise UsageError(f"data folder {folder} has no data files: it {held}\n"
                         f"    fix: add files ending in {_supported()}, or point train.dataset at the folder that has them")
    builders = {BUILDERS[p.suffix.lower()] for p in files}
    if len(builders) > 1:
        raise UsageError(f"data folder {folder} mixes file kinds ({', '.join(sorted(builders))})\n"
                         "    fix: keep one kind of file per folder, or point at a single file")
    return builders.pop(), [str(p) for p in files]


def _looks_like_path(spec: str) -> bool:
    return spec.startswith(PATH_PREFIXES) or Path(spec).suffix.lower() in BUILDERS


def local_source(spec: str, preference: bool = False) -> tuple[str, list[str]] | None:
    """(datasets builder, data files) of builtin or a local file or folder; None for a hub id. Reads no data,
    so it runs before any rank trains; raises UsageError for a missing path or files it cannot read.
    preference: builtin is the embedded preference set, not the corpus."""
    if spec == BUILTIN:
        return "json", [str(BUILTIN_PREFERENCE if preference else BUILTIN_CORPUS)]
    path = Path(spec).expanduser()
    if path.is_dir():
        return _files_in(path)
    if path.is_file():
        return _builder_for(path), [str(path)]
    if _looks_like_path(spec):
        raise UsageError(f"data file {spec} does not exist\n    fix: check the path, or use {BUILTIN!r}")
    return None


def source_fingerprint(spec: DataSpec) -> str:
    """Identity of the source without reading it: each local file's path, size and mtime (what `datasets`
    keys its own cache on), or the hub id, config and split. Cheap, so every rank can compute it."""
    local = local_source(spec.dataset, spec.builtin_pairs)
    if local is None:
        return f"hub:{spec.dataset}:{spec.config}:{spec.split}"
    stats = [f"{f}:{Path(f).stat().st_size}:{Path(f).stat().st_mtime_ns}" for f in local[1]]
    return "files:" + hashlib.sha256("\n".join(stats).encode()).hexdigest()


def _hub_failure(spec: DataSpec, err: Exception) -> UsageError:
    first = str(err).splitlines()[0] if str(err) else ""
    where = spec.dataset + (f" (config {spec.config!r})" if spec.config else "") + f" split {spec.split!r}"
    return UsageError(
        f"cannot load dataset {where}: not {BUILTIN!r}, not a local file or folder, and the Hugging Face Hub "
        f"lookup failed ({type(err).__name__}: {first})\n    fix: use {BUILTIN!r} or a local file "
        f"({_supported()}); with network unset HF_DATASETS_OFFLINE/HF_HUB_OFFLINE and check the id, "
        "train.dataset_config and train.dataset_split (or run `harness data prepare` where there is network)")


def _hub_is_large(spec: DataSpec) -> bool:
    import datasets

    info = datasets.load_dataset_builder(spec.dataset, spec.config or None).info
    return (info.dataset_size or info.download_size or 0) > STREAM_BYTES


def load_raw(spec: DataSpec, streaming: bool | None = None):
    """datasets.Dataset (or IterableDataset when streamed) of the spec's split, before column checks.

    streaming=None: hub datasets larger than STREAM_BYTES are streamed, everything else is loaded."""
    import datasets

    local = local_source(spec.dataset, spec.builtin_pairs)
    if local is not None:
        builder, files = local
        split = "train"  # a file's records are all in datasets' default split
        return datasets.load_dataset(builder, data_files=files, split=split, streaming=bool(streaming))
    try:
        stream = _hub_is_large(spec) if streaming is None else streaming
        return datasets.load_dataset(spec.dataset, spec.config or None, split=spec.split, streaming=stream)
    except Exception as err:  # datasets raises many types (ConnectionError, DatasetNotFoundError, ...)
        raise _hub_failure(spec, err) from None


def load_dataset_for(spec: DataSpec, streaming: bool | None = None):
    """The spec's records with only the columns its format reads (checked, each named in the error)."""
    spec.columns  # an unknown format fails before anything is read
    ds = load_raw(spec, streaming)
    have = list(ds.column_names or [])
    for key, column in spec.columns.items():
        if have and column not in have:
            raise UsageError(f"dataset {spec.dataset!r} has no column {column!r} ({spec.column_note(key)}); its columns "
                             f"are: {', '.join(have)}\n    fix: {spec.column_fix(key)}")
    optional = [c for c in spec.optional_columns.values() if c in have]
    return ds.select_columns(list(spec.columns.values()) + optional) if have else ds
