"""Checks of a vision-language run before any rank starts (exit 2 with the field, the file and record, the fix):
layouts that cannot take it, the format, the processor and its image token, and every local record's images (the
file exists, image parts match the `images` column and the rendered placeholders); and images or vision.freeze under a
text-only model. Decoding errors (a file Pillow cannot read) surface when the store is prepared, with file and
record, before the engine is built."""

from __future__ import annotations

import json
from pathlib import Path

from harness.errors import Problem, UsageError

HEAD_RECORDS = 200  # records per local file whose placeholders are rendered and counted before launch


def _local_records(spec):
    """(file, [(number, record)]) of each local JSON/JSON-lines file (others are checked when the store is made)."""
    from harness.data.corpus import local_source

    try:
        local = local_source(spec.dataset)
    except UsageError:
        return []
    out = []
    for name in (local or (None, []))[1]:
        if not name.endswith((".json", ".jsonl")):
            continue
        text = Path(name).read_text()
        try:
            rows = json.loads(text) if name.endswith(".json") else \
                [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError:
            continue  # the data checks report it
        out.append((name, list(enumerate(rows if isinstance(rows, list) else [], start=1))))
    return out


def _layout_problems(spec, model_type: str | None) -> list[Problem]:
    from harness.config.vision_rules import layout_problems

    return [Problem(*p) for p in layout_problems(model_type, {"pipeline": ("parallel.pipeline", spec.pp),
                                                              "tensor": ("parallel.tensor", spec.tp),
                                                              "sequence": ("parallel.sequence", spec.sp)})]


def _record_problems(spec, ctx) -> list[Problem]:
    """Every local record's image files and image-part counts; the first records' rendered placeholders."""
    from harness.data.vision import _refs, chat_pieces, image_parts

    for name, rows in _local_records(spec):
        base = Path(name).parent
        for number, record in rows:
            where = f"{name} record {number}"
            try:
                messages = record.get(spec.messages_field) if isinstance(record, dict) else None
                refs = _refs(record, messages, where) if isinstance(messages, list) else []
                for ref in refs:
                    path = Path(str(ref)).expanduser()
                    path = path if path.is_absolute() else base / path
                    if isinstance(ref, str) and not path.is_file():
                        raise UsageError(f"{where}: image {path} does not exist\n    fix: correct the path (relative "
                                         f"paths start at the data file's folder {base}), or remove the image part")
                _video_problems(messages, base, where, ctx)
                if number <= HEAD_RECORDS and isinstance(messages, list):
                    text = "".join(t for t, _ in chat_pieces(ctx.tokenizer, messages, where))
                    text = text.replace(*ctx.marker) if ctx.marker else text  # Gemma 3: <start_of_image> -> ...
                    ids = ctx.tokenizer(text, add_special_tokens=False)["input_ids"]
                    marks = ids.count(ctx.image_token)
                    if marks != len(image_parts(messages)):
                        raise UsageError(f"{where}: {len(image_parts(messages))} image parts but the rendered "
                                         f"conversation holds {marks} image placeholders\n    fix: one image part per "
                                         "image and no literal image marker in the text")
                    _video_count(messages, ids, where, ctx)
            except UsageError as e:
                why, _, fix = str(e).partition("\n    fix: ")
                return [Problem("train.dataset", why, fix)]
    return []


def _video_problems(messages, base: Path, where: str, ctx) -> None:
    """Every video part: a family that takes video, its frames or file there, PyAV for a file (harness/data/video.py)."""
    from harness.data import video

    parts = video.video_parts(messages) if isinstance(messages, list) else []
    if parts and not video.supports_video(ctx.config):
        raise video.unsupported(ctx.config, ctx.name, where)
    for part in parts:
        frames, path = video.source(part, base, where)
        if path is not None:
            video.need_decoder(path, where)


def _video_count(messages, ids: list[int], where: str, ctx) -> None:
    from harness.data.video import video_parts

    parts, token = len(video_parts(messages)), getattr(ctx.config, "video_token_id", None)
    shown = ids.count(token) if token is not None else 0
    if shown != parts:
        raise UsageError(f"{where}: {parts} video parts but the rendered conversation holds {shown} video "
                         "placeholders\n    fix: one video part per video and no literal <|video_pad|> in the text")


def _text_model_problems(spec, recipe) -> list[Problem]:
    from harness.data.vision import has_images

    out = []
    if recipe.get("vision", {}).get("freeze"):
        out.append(Problem("vision.freeze", f"{recipe['vision']['freeze']} but train.model {recipe['train']['model']} "
                           "is a text-only model (no vision_config)", "drop vision.freeze, or train a "
                           "vision-language model"))
    for name, rows in _local_records(spec):
        for number, record in rows[:HEAD_RECORDS]:
            if isinstance(record, dict) and has_images([record], spec.messages_field):
                out.append(Problem("train.dataset", f"{name} record {number} has images but train.model "
                                   f"{recipe['train']['model']} is a text-only model", "train a vision-language "
                                   "model (a config with a vision_config: Qwen2-VL, LLaVA, ...), or drop the images"))
                return out
    return out


def problems(spec, cfg: dict) -> list[Problem]:
    from harness.data.corpus import DataSpec

    recipe = spec.recipe
    data = DataSpec.from_train(recipe["train"])
    if not (cfg or {}).get("vision_config"):
        return _text_model_problems(data, recipe) if data.format == "chat" or recipe.get("vision", {}).get(
            "freeze") else []
    out = _layout_problems(spec, cfg.get("model_type"))
    if recipe["train"].get("streaming"):
        out.append(Problem("train.streaming", "true for a vision-language model: its store (tokens and preprocessed "
                           "images) is prepared whole before training", "set train.streaming=false"))
    if recipe["train"].get("datasets"):
        out.append(Problem("train.datasets", f"a mixture of {len(recipe['train']['datasets'])} sources for a "
                           "vision-language model: a mixture reads token stores, which hold no images",
                           "name one chat dataset in train.dataset: its text-only records mix freely with the image "
                           "records (one file or folder)"))
    if recipe["train"].get("objective", "lm") != "lm":
        out.append(Problem("train.objective", f"{recipe['train']['objective']!r} for a vision-language model: only "
                           "the next-token objective (lm) reads images here", "set train.objective=lm"))
    out += _lora_problems(recipe, cfg)
    if data.format != "chat":
        return out + [Problem("train.format", f"{data.format!r} for vision-language model "
                              f"{recipe['train']['model']}", 'train.format=chat: messages whose content parts hold the '
                              'images ({"type": "image", "image": "cat.png"}); text-only records mix in freely')]
    try:
        ctx = _context(recipe, data)
    except UsageError as e:
        why, _, fix = str(e).partition("\n    fix: ")
        return out + [Problem("train.model", why, fix)]
    return out + _record_problems(data, ctx)


def _lora_problems(recipe, cfg: dict) -> list[Problem]:
    """vision.lora's parts have modules to adapt (on the meta model: Gemma 3's projector has no Linear layer)."""
    from harness.config.adapter_rules import lora_on
    from harness.model.vision import lora_targets
    from harness.planner.vision import meta_model

    if not lora_on(recipe):
        return []
    try:
        lora_targets(meta_model(cfg), recipe["adapter"]["target_modules"], recipe["vision"]["lora"])
    except UsageError as e:
        why, _, fix = str(e).partition("\n    fix: ")
        return [Problem("vision.lora", why, fix)]
    return []


def _context(recipe, data):
    """What the record checks need: the tokenizer, the image token (checked in its vocabulary), the processor."""
    from types import SimpleNamespace

    from harness.model.hf import load_model_config, load_tokenizer
    from harness.model.vision import image_token_id, load_image_processor

    name = recipe["train"]["model"]
    config = load_model_config(name)
    tokenizer = load_tokenizer(name)
    load_image_processor(name, config)
    if not getattr(tokenizer, "chat_template", None):
        raise UsageError(f"the tokenizer of {name} has no chat template\n    fix: save the model's own processor / "
                         "tokenizer (with its chat template) in the folder")
    token = image_token_id(config)
    if token is None or token >= len(tokenizer):
        raise UsageError(f"the tokenizer of {name} ({len(tokenizer)} tokens) has no image token (config "
                         f"image_token_id {token}): a text-only tokenizer\n    fix: save the model's own processor / "
                         "tokenizer in the folder (processor.save_pretrained(dir))")
    from harness.data.vision import image_marker

    return SimpleNamespace(tokenizer=tokenizer, image_token=token, config=config, name=name,
                           marker=image_marker(tokenizer, config))
