"""Checks of this machine and of the run's inputs, made before any rank trains.

Each finds what would otherwise fail minutes into a job (or on every rank with a traceback): a DeepSpeed op
that cannot be built here, a sequence longer than the model's positions, tokenizer ids past the embedding,
a run folder or NVMe path that cannot be written or has no room for what the planner says it will hold, a
dataset smaller than one global batch. Problems are collected and raised once (exit 2, rank 0 prints them).

`before_init` runs from session.prepare (no process group yet); `data_fits` runs once the data is packed,
before the engine is built (packing happens after init so rank 0 tokenizes once for every rank).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from harness import model_shapes
from harness.config.adapter_rules import lora_on
from harness.config.defaults import PATH_PREFIXES
from harness.config.preference_rules import is_preference
from harness.config.run_model import Zero, optimizer_states
from harness.errors import Problem, UsageError, raise_if_errors
from harness.model import fp8
from harness.model.moe import rules as moe_rules
from harness.rl.generation import generator_problems
from harness.train import faults, stochastic_round, vision_checks
from harness.train.teacher_checks import teacher_problems



def inputs(train: dict, source: str) -> dict:
    """The model's HF config; raises ConfigError when train.model or train.dataset cannot be found (checked
    before the DeepSpeed config, whose "auto" values need the model's shape)."""
    cfg, problems = input_problems(train)
    raise_if_errors(problems, source)
    return cfg


def before_init(spec, ds_json: str | None = None) -> None:
    """Raise ConfigError listing every problem found; `ds_json` is the --ds-config file, if one was given."""
    from harness.config.validate import with_recipe_paths

    cfg = spec.model_config  # read by inputs()
    problems = op_problems(spec.ds_config) + model_problems(spec.recipe["train"], cfg)
    problems += path_problems(spec, cfg) + qlora_problems(spec.recipe) + sequence_problems(spec, cfg)
    problems += attention_problems(spec) + preference_problems(spec.recipe) + reference_problems(spec.recipe, cfg)
    problems += chat_problems(spec.recipe["train"]) + teacher_problems(spec.recipe, cfg, model_config)
    problems += faults.recipe_problems(spec.recipe) + mixture_problems(spec.recipe) + generator_problems(spec.recipe)  # rl.generator=vllm
    problems += tool_problems(spec.recipe) + fp8.problems(spec)  # rl.tools' files and chat template; train.fp8 (CUDA)
    problems += vision_checks.problems(spec, cfg)  # vision-language: layouts, processor, images; images on text models
    problems += moe_rules.problems(spec.recipe, spec.world_size, cfg) + stochastic_round.problems(spec.recipe)
    if ds_json is None:  # name the recipe key the user wrote
        problems = with_recipe_paths(problems, spec.recipe.get("deepspeed", {}))
    warnings = raise_if_errors(problems, f"{ds_json or spec.recipe_name} on this machine")
    if spec.launch.rank == 0:  # e.g. the bytes of a materialised document mask on a GPU
        from harness.log import say

        for warning in warnings:
            say("warn", warning.render())


def tool_problems(recipe: dict) -> list[Problem]:
    """A multi-turn run (rl.tools, rl.environment_factory): the tools and environment classes load and have
    schemas, and the model's chat template renders a tool exchange prefix-preserving, with parseable calls
    (harness/rl/tools.py, chat_turns.py)."""
    from pathlib import Path

    from harness.model.hf import load_tokenizer
    from harness.rl import chat_turns
    from harness.rl.tools import load_toolbox

    rl = recipe.get("rl") or {}
    if recipe["train"].get("objective") != "grpo" or rl.get("replay") or \
            not (rl.get("tools") or rl.get("environment_factory")):
        return []
    try:
        load_toolbox(rl, Path.cwd())
    except UsageError as e:
        return [_as_problem("rl.tools", e)]
    try:
        tokenizer = load_tokenizer(recipe["train"]["model"])
    except UsageError:
        return []  # model_problems lists it
    return chat_turns.problems(tokenizer, rl.get("chat_template_kwargs") or {})


def mixture_problems(recipe: dict) -> list[Problem]:
    """train.datasets: names, formats the objective reads, each source's files (harness/data/mixture.py)."""
    from harness.data.mixture import problems
    from harness.model.hf import load_tokenizer

    return problems(recipe, load_tokenizer)


def attention_problems(spec) -> list[Problem]:
    """Document packing with an attention that would drop the mask, or materialise one past the bound
    (harness/model/attention.py)."""
    from harness.model import attention

    return attention.recipe_problems(spec.recipe, spec.ds_config["train_micro_batch_size_per_gpu"],
                                     image_blocks=attention.has_image_blocks(spec.model_config))


def _head_problems(train: dict, check) -> list[Problem]:
    """check(DataSpec, tokenizer) over the first records of the dataset: the problems it returns, or its UsageError
    as a train.dataset problem. A tokenizer that cannot load is model_problems' to list."""
    from harness.data.corpus import DataSpec
    from harness.model.hf import load_tokenizer

    try:
        tokenizer = load_tokenizer(train["model"])
    except UsageError:
        return []
    try:
        return check(DataSpec.from_train(train), tokenizer)
    except UsageError as e:
        return [_as_problem("train.dataset", e)]


def preference_problems(recipe: dict) -> list[Problem]:
    """A preference objective: the first records of each local file tokenized as pairs (malformed records, empty
    completions, a prompt that fills seq_len; harness/data/preference_store.check_head)."""
    from harness.data.corpus import DataSpec
    from harness.data.preference_store import check_head

    train = recipe["train"]
    if not DataSpec.from_train(train).preference:  # the objectives that read pairs (objectives.py: data "pairs")
        return []
    return _head_problems(train, lambda data, tok: check_head(data, tok, train["seq_len"],
                                                              recipe["preference"]["truncation"]) or [])


def _chat_head(data, tokenizer, model: str) -> list[Problem]:
    from harness.data.chat_check import check_chat_head
    from harness.data.formats import check_chat_template

    check_chat_template(tokenizer, model, data.format)
    checked, split = check_chat_head(data, tokenizer)
    if not split:
        return []
    return [Problem("train.dataset", f"the chat template renders {split} of the first {checked} records differently "
                    "once later messages follow (it rewrites history, e.g. drops earlier <think> blocks): their "
                    "assistant turns train in more than one sample, each in the context it has at inference",
                    "nothing to fix; train.chat_turns=last trains only each record's last assistant turn (one "
                    "sample per record)", severity="warning")]


def chat_problems(train: dict) -> list[Problem]:
    """Chat and sharegpt: the first records of each local file rendered by the tokenizer's chat template as they
    will train (harness/data/chat_check.py); a note when the template rewrites history."""
    from harness.data.corpus import DataSpec

    data = DataSpec.from_train(train)
    if data.preference or not data.uses_chat_template:
        return []
    return _head_problems(train, lambda data, tok: _chat_head(data, tok, train["model"]))


def sequence_problems(spec, cfg: dict) -> list[Problem]:
    """Ulysses degrees, attention and activation offload (harness/model/sequence/rules.py)."""
    import torch

    from harness.model.sequence import rules

    return rules.problems(spec.recipe, cfg, spec.sp, spec.world_size, spec.pp, spec.tp, torch.cuda.is_available())


def qlora_problems(recipe: dict) -> list[Problem]:
    """A 4-bit base needs bitsandbytes' CUDA kernels and pretrained weights to quantize."""
    import importlib.util

    import torch

    if not lora_on(recipe) or not recipe["adapter"]["load_in_4bit"]:
        return []
    out = []
    if not torch.cuda.is_available():
        out.append(Problem("adapter.load_in_4bit", "QLoRA's 4-bit base needs bitsandbytes on a CUDA GPU; this machine "
                           f"has none (torch {torch.__version__})", "run on a GPU node, or set adapter.load_in_4bit=false "
                           "(plain LoRA trains on CPU)"))
    elif importlib.util.find_spec("bitsandbytes") is None:
        out.append(Problem("adapter.load_in_4bit", "QLoRA needs the bitsandbytes package, which is not installed",
                           "pip install bitsandbytes (the GPU image has it), or set adapter.load_in_4bit=false"))
    if model_shapes.is_preset(recipe["train"]["model"]):
        out.append(Problem("adapter.load_in_4bit", f"preset {recipe['train']['model']!r} has random weights, nothing "
                           "to quantize", "use a pretrained model folder or hub id"))
    return out


def op_problems(ds: dict) -> list[Problem]:
    from harness import ops

    out = []
    for name, path in ops.needed_ops(ds).items():
        found = ops.op_problem(name)
        if found is not None:
            device = path.rsplit(".", 1)[0].split(".")[-1]
            out.append(Problem(path, f"{device} needs DeepSpeed's {name} op: {found[0]}", found[1]))
    for name, who in ops.init_ops().items():
        found = ops.op_problem(name)
        if found is not None:
            out.append(Problem(who, f"DeepSpeed builds its {name} op when the process group starts: {found[0]}",
                               found[1]))
    return out


def model_config(name: str) -> dict:
    """HF config dict of a preset, known shape or local dir, else of a hub id the way the job will load it (the
    HF cache, or the hub when online): a model that cannot be loaded fails here, not after init."""
    try:
        return model_shapes.load_model_config(name)
    except UsageError:
        if Path(name).exists() or name.startswith(PATH_PREFIXES):
            raise
    from harness.model.hf import load_model_config

    return model_shapes.with_text_fields(load_model_config(name).to_dict())


def _as_problem(path: str, err: UsageError) -> Problem:
    why, _, fix = str(err).partition("\n    fix: ")
    return Problem(path, why, fix)


def input_problems(train: dict) -> tuple[dict | None, list[Problem]]:
    """(the model's config or None, problems of train.model and train.dataset) without loading any data."""
    from harness.data.corpus import DataSpec
    from harness.data.files import check_local

    out, cfg = [], None
    try:
        check_local(DataSpec.from_train(train))  # the path exists, and its files hold records datasets can read
    except UsageError as e:
        out.append(_as_problem("train.dataset", e))
    try:
        cfg = model_config(train["model"])
    except UsageError as e:
        out.append(_as_problem("train.model", e))
    return cfg, out


def max_positions(cfg: dict) -> tuple[str, int] | None:
    for key in ("max_position_embeddings", "n_positions"):
        if isinstance(cfg.get(key), int):
            return key, cfg[key]
    return None


def model_problems(train: dict, cfg: dict) -> list[Problem]:
    name, seq_len, out = train["model"], train["seq_len"], []
    positions = max_positions(cfg)
    if positions is not None and seq_len > positions[1]:
        key, limit = positions
        out.append(Problem("train.seq_len", f"{seq_len} tokens per sequence, but model {name} has {limit} "
                           f"positions ({key} in its config): it would train past them (or fail) for the whole run",
                           f"--set train.seq_len={limit} or less, or a model with more positions"))
    vocab = cfg.get("vocab_size")
    if isinstance(vocab, int):
        from harness.model.hf import load_tokenizer

        try:
            tok = load_tokenizer(name)
        except UsageError as e:  # listed with the other problems rather than alone
            return out + [_as_problem("train.model", e)]
        num_ids = max(len(tok), max(tok.get_vocab().values(), default=-1) + 1)
        if num_ids > vocab:
            out.append(Problem("train.model", f"the tokenizer of {name} has {num_ids} ids (0..{num_ids - 1}) but "
                               f"the model's vocab_size is {vocab}: ids >= {vocab} have no embedding row (index "
                               "error on CPU, device-side assert on CUDA)",
                               "use the tokenizer saved with this model (tokenizer.save_pretrained into its "
                               "folder), or a model whose vocab_size covers the tokenizer"))
    return out


def reference_problems(recipe: dict, cfg: dict) -> list[Problem]:
    """A dpo / ipo reference of another architecture or vocabulary than the policy (its config.json only)."""
    ref = recipe.get("preference", {}).get("reference")
    if not is_preference(recipe) or ref is None:
        return []
    try:
        other = model_config(ref)
    except UsageError as e:
        return [_as_problem("preference.reference", e)]
    return [Problem("preference.reference", f"{key} {other.get(key)!r} of the reference, {cfg.get(key)!r} of the "
                    f"policy: their log-probs of the same tokens do not compare (reference {ref}, policy "
                    f"{recipe['train']['model']})",
                    "use a reference of the policy's architecture and tokenizer (the model the policy starts from)")
            for key in ("model_type", "vocab_size") if other.get(key) != cfg.get(key)]


def existing(path: Path) -> Path:
    path = path.expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def unwritable(path: Path) -> str | None:
    """Why a folder cannot be made at `path` and written into, or None. Probes by creating (and removing) a
    folder: as root, os.access says yes to /proc and to read-only mounts."""
    base = existing(path)
    if path.exists() and not path.is_dir():
        return f"{path} is a file, not a folder"
    if not base.is_dir():
        return f"{base} is a file, so no folder can be made under it"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".dsharness-probe-", dir=base))
    except OSError as e:
        return f"cannot create anything in {base} ({e.strerror})"
    return None


def _precision(ds: dict) -> str:
    for name in ("bf16", "fp16"):
        if (ds.get(name) or {}).get("enabled") is True:
            return name
    return "fp32"


def _needs(spec, cfg: dict) -> dict[str, tuple[str, int]]:
    """{place: (what, bytes)} the planner expects: one checkpoint in the run folder, swap files on NVMe."""
    from harness.planner import memory
    from harness.planner.params import count_params

    try:
        total = count_params(cfg).total
    except Exception:  # an architecture the planner cannot count: no size to check against
        return {}
    precision, states = _precision(spec.ds_config), optimizer_states(spec.ds_config)
    per_param = memory.checkpoint_bytes(1, precision, optimizer_states=states)
    kept = f" + {states} fp32 optimizer state{'s' if states > 1 else ''}" if states else ""  # Adam: its 2 moments
    out = {"output": (f"one checkpoint ({total:,} params x {per_param} B: {precision} weights + fp32 master{kept})",
                      memory.checkpoint_bytes(total, precision, optimizer_states=states))}
    zo = spec.ds_config.get("zero_optimization", {})
    devices = {b: (zo.get(b) or {}).get("device", "none") for b in ("offload_optimizer", "offload_param")}
    if zo.get("stage") == 3 and "nvme" in devices.values():
        local_ranks = spec.launch.local_size
        zero = Zero(3, devices["offload_optimizer"], devices["offload_param"])
        held = memory.Holding(total // (spec.tp * spec.pp), optimizer_states=states)
        per_rank = memory.by_device(memory.model_state_bytes(held, zero, zero_shards=spec.zero_shards,
                                                             precision=precision))["nvme"]
        out["nvme"] = (f"NVMe swap files ({per_rank:,} B per rank x {local_ranks} on this node)",
                       per_rank * local_ranks)
    return out


def _gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e7 else f"{nbytes:,} B"


def path_problems(spec, cfg: dict) -> list[Problem]:
    """Run folder and NVMe path: creatable, writable, and with room for what the planner says they will hold."""
    zo = spec.ds_config.get("zero_optimization", {})
    places = {"output": ("--output-dir" if spec.output_dir is not None else "train.output_dir",
                         spec.output_dir or Path(spec.recipe["train"]["output_dir"]))}
    for block in ("offload_param", "offload_optimizer"):
        conf = zo.get(block) or {}
        if conf.get("device") == "nvme" and conf.get("nvme_path"):
            places.setdefault("nvme", (f"zero_optimization.{block}.nvme_path", Path(conf["nvme_path"])))
    needs, out, by_disk = _needs(spec, cfg), [], {}
    for place, (flag, path) in places.items():
        why = unwritable(path)
        if why:
            out.append(Problem(flag, why, "point it at a folder this user can create and write"))
        elif place in needs:
            by_disk.setdefault(os.stat(existing(path)).st_dev, []).append((flag, path, *needs[place]))
    for entries in by_disk.values():  # the run folder and NVMe swap on one disk share its free space
        free = shutil.disk_usage(existing(entries[0][1])).free
        need = sum(e[3] for e in entries)
        if need > free:
            held = " + ".join(f"{what} {_gb(nbytes)} at {path}" for _, path, what, nbytes in entries)
            total = f" = {_gb(need)}" if len(entries) > 1 else ""
            out.append(Problem(entries[0][0], f"not enough free space: needs {held}{total}, but "
                               f"{existing(entries[0][1])} has {_gb(free)} free",
                               f"free space there, or point it at a disk with {_gb(need)} free"))
    return out


def data_fits(spec, num_rows: int, seq_len: int) -> None:
    """The packed training rows must fill one global batch (the BatchPlan invariant), said as exit 2."""
    micro, accum = spec.run.batch.micro_batch, spec.run.batch.grad_accum
    dp = spec.dp  # the tensor (and pipeline) ranks of one replica read the same rows (trainer.dp_coords)
    rows = micro * accum * dp
    if num_rows < rows and is_preference(spec.recipe):  # a row is a pair (two sequences), whatever seq_len
        train = spec.recipe["train"]
        raise UsageError(
            f"train.dataset {train['dataset']!r}: {num_rows} training pairs (after holding out eval_fraction="
            f"{train['eval_fraction']}), fewer than one global batch: {micro} micro x {accum} accum x {dp} dp = "
            f"{rows} pairs\n    fix: more pairs, a smaller batch (--set batch.micro_batch_per_gpu=1, "
            "batch.grad_accum_steps=1) or fewer ranks")
    if num_rows < rows:
        train = spec.recipe["train"]
        raise UsageError(
            f"train.dataset {train['dataset']!r}: {num_rows} training rows of seq_len={seq_len} tokens "
            f"({num_rows * seq_len:,} tokens after holding out eval_fraction={train['eval_fraction']}), fewer "
            f"than one global batch: {micro} micro x {accum} accum x {dp} dp = {rows} rows = {rows * seq_len:,} "
            "tokens\n    fix: more text, a smaller batch (--set batch.micro_batch_per_gpu=1), fewer ranks, "
            "or a shorter train.seq_len")
