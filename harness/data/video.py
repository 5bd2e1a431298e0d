"""Video parts of chat records, for the families whose vision tower takes video (Qwen2-VL, Qwen2.5-VL): the frames
are read and sampled, preprocessed once (per frame by the family's image processor, then grouped in time as
transformers' Qwen2-VL video processor groups them) into the store beside the images (harness/data/vision.py).

A part, as transformers' and Qwen's chat format write it: {"type": "video", "video": REF, ...} where REF is
  - a list of frame image paths (taken as already sampled, in order: no extra package needed),
  - a folder of frame images (its image files in name order, the same),
  - a video file (decoded with PyAV through transformers' own loader, `transformers.video_utils.load_video`:
    `pip install av`, the `video` extra; a teaching error when it is missing).
Paths are relative to the data file's folder, or absolute. Optional keys, by Qwen's (qwen-vl-utils) and
transformers' names: `fps` (frames per second to sample from a file, default 2.0; for a list or folder, the rate the
frames were taken at, which Qwen2.5-VL turns into time positions), `nframes` (or transformers' `num_frames`: exactly
this many, uniformly), `min_frames` (4) and `max_frames` (768), `min_pixels` / `max_pixels` (each frame's size
bounds; default the image processor's). Defaults are overridden by a `video_preprocessor_config.json` beside the model
when it has these keys (read as JSON: transformers' video processor class itself needs torchvision).

Frames are sampled as transformers' Qwen2VLVideoProcessor.sample_frames does (indices arange(0, total, total / n)),
padded to a multiple of temporal_patch_size (2) by repeating the last frame, and laid out as its patchify does:
rows (t, h / merge, w / merge, merge, merge), columns (channel, time in the patch, patch row, patch column); the
grid is [frames / 2, h / 14, w / 14] (video_grid_thw), and `second_per_grid` = temporal_patch_size / sampled fps
(Qwen2.5-VL's second_per_grid_ts).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from harness.errors import UsageError

IMAGE, VIDEO = 1, 2  # transformers' mm_token_type_ids: text 0, image 1, video 2
VIDEO_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")  # the families whose forward here feeds videos
FRAME_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")
DEFAULTS = {"fps": 2.0, "min_frames": 4, "max_frames": 768}  # qwen-vl-utils' FPS; Qwen2VLVideoProcessor's bounds
SAMPLING_KEYS = ("fps", "nframes", "num_frames", "min_frames", "max_frames", "min_pixels", "max_pixels")


@dataclass
class Video:
    pixels: np.ndarray  # float32 [t * h * w, channels * temporal_patch_size * patch ** 2]
    grid: list[int]  # [t, h, w] (video_grid_thw)
    second_per_grid: float


def content_parts(messages, kind: str) -> list[dict]:
    """A conversation's content parts of one type ("image", "video"), in order (data/vision.py's image parts too)."""
    out = []
    for message in messages or ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            out += [p for p in content if isinstance(p, dict) and p.get("type") == kind]
    return out


def video_parts(messages) -> list[dict]:
    """The video parts of a conversation, in order."""
    return content_parts(messages, "video")


def supports_video(config) -> bool:
    return getattr(config, "model_type", "") in VIDEO_MODEL_TYPES and getattr(config, "video_token_id", None) is not None


def unsupported(config, model: str, where: str) -> UsageError:
    kind = getattr(config, "model_type", "?")
    why = ("its forward here does not feed Qwen3-VL's deepstack features and timestamped frames yet"
           if "qwen3" in kind else "its vision tower takes images only")
    return UsageError(f"{where}: a video part, but train.model {model} ({kind}) has no video path: {why}\n"
                      "    fix: train a Qwen2-VL or Qwen2.5-VL model for video, or give the frames as image parts")


def _resolve(ref, base: Path) -> Path:
    path = Path(str(ref)).expanduser()
    return path if path.is_absolute() else base / path


def source(part: dict, base: Path, where: str) -> tuple[list[Path] | None, Path | None]:
    """(frame paths, None) for a list or folder of frames, (None, file) for a video file; missing ones are errors."""
    ref = part.get("video", part.get("path"))
    if ref is None or ref == [] or ref == "":
        raise UsageError(f"{where}: a video part without its frames or file\n    fix: "
                         '{"type": "video", "video": "clip.mp4"} or {"type": "video", "video": ["f0.png", "f1.png"]}')
    if isinstance(ref, (list, tuple)):
        frames = [_resolve(r, base) for r in ref]
        for frame in frames:
            if not frame.is_file():
                raise UsageError(f"{where}: video frame {frame} does not exist\n    fix: correct the frame paths "
                                 f"(relative paths start at the data file's folder {base}), or remove the video part")
        return frames, None
    path = _resolve(ref, base)
    if path.is_dir():
        frames = sorted(p for p in path.iterdir() if p.suffix.lower() in FRAME_SUFFIXES)
        if not frames:
            raise UsageError(f"{where}: video folder {path} holds no frame images ({', '.join(FRAME_SUFFIXES)})\n"
                             "    fix: put the frames in it as image files (name order is time order)")
        return frames, None
    if not path.is_file():
        raise UsageError(f"{where}: video {path} does not exist\n    fix: correct the path (relative paths start at "
                         f"the data file's folder {base}), or remove the video part")
    return None, path


def need_decoder(path: Path, where: str) -> None:
    try:
        import av  # noqa: F401
    except ImportError:
        raise UsageError(f"{where}: video file {path} needs PyAV to be decoded, and `import av` fails here\n"
                         "    fix: pip install av (or the harness's `video` extra: pip install -e '.[video]'), or give "
                         "the video as a list or folder of frame images") from None


def defaults_of(model_dir: str | None) -> dict:
    """DEFAULTS, overridden by the model folder's video_preprocessor_config.json where it names them."""
    out = dict(DEFAULTS)
    path = Path(model_dir or "") / "video_preprocessor_config.json"
    if model_dir and path.is_file():
        saved = json.loads(path.read_text())
        size = saved.get("size") or {}
        saved.update({"min_pixels": size.get("shortest_edge"), "max_pixels": size.get("longest_edge")} if size else {})
        out.update({k: saved[k] for k in SAMPLING_KEYS if saved.get(k) is not None})
    return out


def sample_indices(total: int, video_fps: float | None, want: dict, temporal: int) -> np.ndarray:
    """Which of `total` frames to keep: Qwen2VLVideoProcessor.sample_frames' arithmetic (transformers 5)."""
    num = want.get("nframes", want.get("num_frames"))
    if num is not None:
        num = round(num / temporal) * temporal
    elif want.get("fps") and video_fps:
        most = math.floor(min(want["max_frames"], total) / temporal) * temporal
        num = min(max(total / video_fps * want["fps"], want["min_frames"]), most, total)
        num = math.floor(num / temporal) * temporal
    if num is None or num >= total or num <= 0:
        return np.arange(total)
    return np.arange(0, total, total / num).astype(int)


def read_frames(part: dict, want: dict, base: Path, where: str, temporal: int, open_image):
    """(frames as RGB images / arrays, sampled fps) of one video part; `want`: the sampling keys in force."""
    frames, path = source(part, base, where)
    if frames is not None:  # already sampled: thinned only to nframes / max_frames
        num = want.get("nframes", want.get("num_frames"))
        num = num if num is not None or len(frames) <= want["max_frames"] else want["max_frames"]
        keep = sample_indices(len(frames), None, {} if num is None else {"nframes": num}, temporal)
        return [open_image(frames[i], base, where) for i in keep], float(want["fps"]) * len(keep) / len(frames)
    need_decoder(path, where)
    from transformers.video_utils import load_video

    def indices(metadata, **_):
        return sample_indices(metadata.total_num_frames, metadata.fps, want, temporal)

    try:
        array, meta = load_video(str(path), backend="pyav", sample_indices_fn=indices)
    except Exception as err:  # PyAV's own errors: not a video, no video stream, a broken file
        raise UsageError(f"{where}: video {path} cannot be decoded ({type(err).__name__}: {err})\n"
                         "    fix: replace it with a file FFmpeg can read (mp4, webm, ...), or give its frames as "
                         "images") from None
    return list(array), float(meta.sampled_fps)


def patches(image_processor, frames: list, want: dict) -> tuple[np.ndarray, list[int]]:
    """Each frame through the image processor alone (temporal patch 1), then grouped by temporal_patch_size in
    transformers' video layout (module docstring)."""
    temporal, patch = image_processor.temporal_patch_size, image_processor.patch_size
    kwargs = {"temporal_patch_size": 1}
    if want.get("min_pixels") or want.get("max_pixels"):
        size = dict(image_processor.size)
        size.update({k: want[n] for k, n in (("shortest_edge", "min_pixels"), ("longest_edge", "max_pixels"))
                     if want.get(n)})
        kwargs["size"] = size
    out = image_processor(images=frames, return_tensors="np", **kwargs)
    grids = np.asarray(out["image_grid_thw"])
    if (grids != grids[0]).any():
        raise ValueError(f"frames of different sizes give different grids {sorted({tuple(g) for g in grids})}")
    _, h, w = (int(x) for x in grids[0])
    per = np.asarray(out["pixel_values"], dtype=np.float32).reshape(len(frames), h * w, -1, patch, patch)
    if pad := -len(frames) % temporal:
        per = np.concatenate([per, np.repeat(per[-1:], pad, axis=0)])
    t = per.shape[0] // temporal
    grouped = per.reshape(t, temporal, h * w, -1, patch, patch).transpose(0, 2, 3, 1, 4, 5)
    return np.ascontiguousarray(grouped.reshape(t * h * w, -1)), [t, h, w]


def encode_video(part: dict, ctx, where: str, open_image) -> Video:
    """One video part -> its patches, grid and seconds per temporal patch."""
    ip = ctx.image_processor
    want = {**ctx.video_defaults, **{k: part[k] for k in SAMPLING_KEYS if part.get(k) is not None}}
    frames, fps = read_frames(part, want, ctx.base, where, ip.temporal_patch_size, open_image)
    try:
        pixels, grid = patches(ip, frames, want)
    except ValueError as err:
        raise UsageError(f"{where}: video {part.get('video')!r}: {err}\n    fix: give every frame of a video "
                         "the same size") from None
    return Video(pixels, grid, ip.temporal_patch_size / fps)
