"""Chat records with images, for a vision-language model (train.format chat): one record -> token ids, a loss mask
and its images, preprocessed once (harness/data/vision_store.py keeps them).

A record is the chat format's `messages` list; a message's content is a string or a list of parts, as in
transformers' and TRL's chat format: {"type": "text", "text": ...} and {"type": "image", "image": PATH} (a path
relative to the data file's folder, or absolute). A part {"type": "image"} without a path takes the next entry of
the record's `images` column (TRL's layout), or its single `image` column (datasets.Image values: PIL images,
{"bytes", "path"} dicts, bytes or paths). Records without images are text-only rows and mix freely with the rest.

The conversation is rendered by the tokenizer's chat template (which writes the family's image marker for each image
part: Qwen-VL `<|vision_start|><|image_pad|><|vision_end|>`, LLaVA `<image>`, Gemma 3 `<start_of_image>`, which
is expanded into its image block as its processor does: image_marker), the loss goes on assistant turns only
(data/chat_template.py, as for text chat), and each image marker is expanded into as many image tokens as the image
processor gives the image features. The counts are checked here, so a mismatch is a clear error before any rank
trains, never a shape error inside the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from harness.data import video
from harness.errors import UsageError

IMAGES_COLUMN = "images"  # TRL's: a record's images, taken in order by parts {"type": "image"} without a path
IMAGE_COLUMN = "image"  # a dataset's single Image column, where it has no `images`


@dataclass
class Encoded:
    ids: list[int]
    mask: list[int]  # 1 where the token is a loss target
    pixels: list[np.ndarray]  # per image: float32, leading dim concatenated per vision call
    grids: list[list[int]]  # per image [t, h, w] (grid families) or []
    kinds: list[int] = field(default_factory=list)  # per visual: video.IMAGE or video.VIDEO ([]: all images)
    seconds: list[float] = field(default_factory=list)  # per visual: seconds per temporal patch (videos)


@dataclass
class Images:
    """One micro-batch's images, in the order their placeholder spans appear (row by row): each image's pixels
    (leading dim concatenated per call) and, for grid families, its [t, h, w]."""

    pixels: list[torch.Tensor]
    grids: list[torch.Tensor]  # [3] each; empty for LLaVA-style families
    kinds: list[int] = field(default_factory=list)  # video.IMAGE / video.VIDEO per visual ([]: all images)
    seconds: list[float] = field(default_factory=list)  # seconds per temporal patch per visual (videos)

    def __len__(self) -> int:
        return len(self.pixels)

    def kind(self, i: int) -> int:
        return self.kinds[i] if self.kinds else video.IMAGE

    def calls(self, per_call: int) -> list[list[int]]:
        """The visuals of each vision-tower call, in order: at most `per_call` units a call, an image one unit and a
        video one per temporal patch (grid t: two frames, an image's worth of patches each); a video is never split,
        one longer than `per_call` gets a call of its own."""
        out, used = [], per_call
        for i in range(len(self.pixels)):
            units = int(self.grids[i][0]) if self.kind(i) == video.VIDEO else 1
            if used + units > per_call or not out:
                out.append([])
                used = 0
            out[-1].append(i)
            used += units
        return out

    def batch(self, group: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One call's input: the group's pixels (and grids) concatenated, images and videos alike."""
        grid = torch.stack([self.grids[i] for i in group]) if self.grids else None
        return torch.cat([self.pixels[i] for i in group]), grid

    def chunks(self, per_call: int) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        return [self.batch(group) for group in self.calls(per_call)]


def image_parts(messages) -> list[dict]:
    """The image parts of a conversation, in order."""
    return video.content_parts(messages, "image")


def _where(source: str, number: int) -> str:
    return f"{source} record {number}"


def open_image(ref, base: Path, where: str):
    """A PIL RGB image from a path (relative to `base`) or a PIL image (an HF dataset's Image column)."""
    from PIL import Image, UnidentifiedImageError

    if hasattr(ref, "convert"):
        return ref.convert("RGB")
    if isinstance(ref, dict) and ref.get("bytes") or isinstance(ref, (bytes, bytearray)):  # Image(decode=False)
        import io

        with Image.open(io.BytesIO(ref["bytes"] if isinstance(ref, dict) else ref)) as img:
            return img.convert("RGB")
    if isinstance(ref, dict):
        ref = ref.get("path")
    path = Path(str(ref)).expanduser()
    path = path if path.is_absolute() else base / path
    if not path.is_file():
        raise UsageError(f"{where}: image {path} does not exist\n    fix: correct the path in the record (relative "
                         f"paths start at the data file's folder {base}), or remove the image part")
    try:
        with Image.open(path) as img:
            return img.convert("RGB")
    except (UnidentifiedImageError, OSError) as err:
        raise UsageError(f"{where}: image {path} cannot be read ({type(err).__name__}: {err})\n"
                         "    fix: replace it with a PNG/JPEG/WebP file Pillow can open, or remove the part") from None


def _column(record: dict) -> list:
    """The record's `images` column, or its single `image` column as a list of one (an HF dataset's Image)."""
    if record.get(IMAGES_COLUMN) is not None:
        return list(record[IMAGES_COLUMN])
    return [record[IMAGE_COLUMN]] if record.get(IMAGE_COLUMN) is not None else []


def _refs(record: dict, messages, where: str) -> list:
    """Each image part's path or image, the parts without one taking the `images` column in order."""
    parts, column = image_parts(messages), _column(record)
    refs, taken = [], 0
    for part in parts:
        ref = part.get("image") or part.get("path") or part.get("url")
        if ref is None:
            if taken >= len(column):
                raise UsageError(f"{where}: {len(parts)} image parts but {len(column)} entries in its "
                                 f"{IMAGES_COLUMN!r} column\n    fix: give each image part a path "
                                 '({"type": "image", "image": "cat.png"}) or list one image per part')
            ref, taken = column[taken], taken + 1
        refs.append(ref)
    return refs


def preprocess(image_processor, images: list, grid: bool) -> tuple[list[np.ndarray], list[list[int]]]:
    """Each image through the family's image processor: (pixels per image, grid per image)."""
    if not images:
        return [], []
    out = image_processor(images=images, return_tensors="np")
    values = np.asarray(out["pixel_values"], dtype=np.float32)
    if not grid:
        return [values[i:i + 1] for i in range(len(images))], []
    grids = np.asarray(out["image_grid_thw"], dtype=np.int64)
    sizes = grids.prod(axis=1)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    return [values[starts[i]:starts[i + 1]] for i in range(len(images))], grids.tolist()


def tokens_per_image(config, pixels: np.ndarray, grid: list[int]) -> int:
    """How many image tokens the model expects for one preprocessed image."""
    vision = config.vision_config
    if getattr(config, "mm_tokens_per_image", None):  # Gemma 3: pooled to a fixed count
        return config.mm_tokens_per_image
    if grid:
        return int(np.prod(grid)) // vision.spatial_merge_size ** 2
    patches = (pixels.shape[-2] // vision.patch_size) * (pixels.shape[-1] // vision.patch_size)
    return patches + (1 if config.vision_feature_select_strategy == "full" else 0)


def image_marker(tokenizer, config) -> tuple[str, str] | None:
    """(what the chat template writes for an image, what it stands for with ONE image token) where the two differ:
    Gemma 3's template writes <start_of_image>, its processor expands it to "\\n\\n<start_of_image>" + the image
    token x mm_tokens_per_image + "<end_of_image>\\n\\n" (the full_image_sequence); None for families whose
    template writes the image token itself (Qwen-VL, LLaVA)."""
    boi, eoi = getattr(config, "boi_token_id", None), getattr(config, "eoi_token_id", None)
    if boi is None or eoi is None or boi >= len(tokenizer):
        return None
    begin, end, image = tokenizer.convert_ids_to_tokens([boi, eoi, config.image_token_id])
    return begin, f"\n\n{begin}{image}{end}\n\n"


def chat_pieces(tokenizer, messages, where: str) -> list[tuple[str, int]]:
    """(text, 1 on assistant turns) pieces of the conversation rendered once by the chat template
    (harness/data/chat_template.py; a template that rewrites earlier turns, like Qwen3's, would need a row per turn
    group, each repeating the images: refused)."""
    from harness.data.chat_template import documents, explain

    try:
        docs, whole = documents(tokenizer, messages)
    except Exception as err:  # RenderProblem or the template's own error
        what, fix = explain(err)
        raise UsageError(f"{where} {what}\n    fix: {fix}") from None
    if not whole:
        raise UsageError(f"{where}: the chat template renders its earlier assistant turns differently once later "
                         "messages follow (as Qwen3's drops old <think> blocks), so the conversation is not one row\n"
                         "    fix: split the conversation into one record per user turn, or use a template that "
                         "renders a conversation as a prefix of its continuation")
    return [piece for doc in docs for piece in doc]


def encode(record: dict, number: int, ctx) -> Encoded:
    """One record -> Encoded. ctx: tokenizer, image_processor, config, grid, image_token, field, base, source,
    video_defaults."""
    where = _where(ctx.source, number)
    messages = record.get(ctx.field)
    if not isinstance(messages, list) or not messages:
        raise UsageError(f"{where}: no {ctx.field!r} list of messages\n    fix: set train.messages_field to the "
                         "column holding the conversation")
    refs = _refs(record, messages, where)
    pixels, grids = preprocess(ctx.image_processor, [open_image(r, ctx.base, where) for r in refs], ctx.grid)
    videos = _videos(messages, ctx, where)
    ids, mask, marker = [], [], image_marker(ctx.tokenizer, ctx.config)
    for text, loss in chat_pieces(ctx.tokenizer, messages, where):
        piece = ctx.tokenizer(text.replace(*marker) if marker else text, add_special_tokens=False)["input_ids"]
        ids += piece
        mask += [loss] * len(piece)
    marks = [i for i, t in enumerate(ids) if t == ctx.image_token]
    if len(marks) != len(refs):
        raise UsageError(f"{where}: {len(refs)} image parts but the rendered conversation holds {len(marks)} image "
                         f"placeholders (token {ctx.image_token})\n    fix: one image part per image, and no literal "
                         "image marker in the text; or a chat template that renders image parts")
    video_token = getattr(ctx.config, "video_token_id", None)  # a literal one without a video part is refused too
    shown = [i for i, t in enumerate(ids) if video_token is not None and t == video_token]
    if len(shown) != len(videos):
        raise UsageError(f"{where}: {len(videos)} video parts but the rendered conversation holds {len(shown)} video "
                         f"placeholders (token {video_token})\n    fix: one video part per video, and no literal "
                         "<|video_pad|> in the text; or a chat template that renders video parts")
    queues = {ctx.image_token: list(zip(pixels, grids or [[]] * len(pixels))),
              video_token: [(v.pixels, v.grid, v.second_per_grid) for v in videos]}
    out, last = Encoded([], [], [], [], [], []), 0
    for mark in sorted(marks + shown):
        pix, grid, *sec = queues[ids[mark]].pop(0)
        count = tokens_per_image(ctx.config, pix, grid)
        out.ids += ids[last:mark] + [ids[mark]] * count
        out.mask += mask[last:mark] + [0] * count
        out.pixels.append(pix), out.grids.append(grid), out.seconds.append(sec[0] if sec else 0.0)
        out.kinds.append(video.VIDEO if sec else video.IMAGE)
        last = mark + 1
    out.ids, out.mask, out.grids = out.ids + ids[last:], out.mask + mask[last:], out.grids if ctx.grid else []
    return out


def _videos(messages, ctx, where: str) -> list:
    parts = video.video_parts(messages)
    if parts and not video.supports_video(ctx.config):
        raise video.unsupported(ctx.config, getattr(ctx.config, "_name_or_path", "") or "the model", where)
    return [video.encode_video(part, ctx, where, open_image) for part in parts]


def has_images(records: list[dict], field: str) -> bool:
    """Any image or video part (or an `image` / `images` column)."""
    return any(image_parts(r.get(field)) or video.video_parts(r.get(field)) or _column(r)
               for r in records if isinstance(r, dict))


def check_text_model(spec, records_by_file) -> None:
    """Images under a text-only model: exit 2 with the file and record (the data's first records are read)."""
    for path, numbers, records in records_by_file:
        for number, record in zip(numbers or range(1, len(records) + 1), records):
            if has_images([record], spec.messages_field):
                raise UsageError(f"{path} record {number} has images but train.model is a text-only model\n"
                                 "    fix: train a vision-language model (a *ForConditionalGeneration folder with "
                                 "a vision_config, e.g. Qwen2-VL or LLaVA), or drop the image parts")
