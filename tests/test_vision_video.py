"""Video input for Qwen2-VL / Qwen2.5-VL (harness/data/video.py), without DeepSpeed ranks: frames are laid out as
transformers' own Qwen2-VL video processor lays them out (its patchify, compiled from its source file, since its
module imports torchvision at the top), and sampled as its sample_frames samples; a record holding a video and an
image gives the loss and gradients of transformers' own forward (pixel_values + pixel_values_videos, 2 tower calls)
through the harness's (1 tower call on both, or 3 with vision.max_images_per_call 1 plus placeholders); a video file
is decoded with PyAV, and its absence is a teaching error. The 2-rank case (rank 0 text, rank 1 video + image) is in
tests/test_vision_language_ranks.py."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from helpers.vl_models import qwen2_5_vl_folder, qwen2_vl_folder, write_frames, write_images, write_mp4


def transformers_video_method(name: str):
    """Qwen2VLVideoProcessor.<name> from transformers' own source (the module needs torchvision to import)."""
    import math

    import transformers.models.qwen2_vl as pkg

    src = Path(pkg.__file__).parent / "video_processing_qwen2_vl.py"
    tree = ast.parse(src.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Qwen2VLVideoProcessor")
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name)
    space = {"torch": torch, "math": math}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(src), "exec"), space)
    return space[name]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlvideo")
    return {"qwen": qwen2_vl_folder(root / "qwen"), "qwen25": qwen2_5_vl_folder(root / "qwen25"), "root": root}


def processor(folder):
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(folder)


def frames_of(paths):
    from PIL import Image

    return [Image.open(p).convert("RGB") for p in paths]


def test_frames_follow_transformers_video_layout(folders, tmp_path):
    """A still video (2 equal frames) gives exactly the image processor's patches of that frame (grid t 1); frames
    A A B B give A's patches then B's (grid t 2); and 3 distinct frames (padded with the last) equal transformers'
    own Qwen2VLVideoProcessor.patchify of the same resized, normalized frames, bit for bit."""
    from harness.data.video import patches

    ip = processor(folders["qwen"])
    a, b, c = frames_of(write_frames(tmp_path / "f", 3))
    still, grid = patches(ip, [a, a], {})
    own = ip(images=[a], return_tensors="np")
    assert grid == own["image_grid_thw"][0].tolist() and np.array_equal(still, own["pixel_values"])
    two, grid2 = patches(ip, [a, a, b, b], {})
    assert grid2 == [2, *grid[1:]]
    assert np.array_equal(two, np.concatenate([own["pixel_values"], ip(images=[b], return_tensors="np")["pixel_values"]]))
    ours, grid3 = patches(ip, [a, b, c], {})
    # the frames as transformers' video processor holds them after resize + rescale + normalize: the image
    # processor's per-frame patches (temporal patch 1) laid back into [channels, height, width]
    _, h, w = grid3
    m, p = ip.merge_size, ip.patch_size
    flat = ip(images=[a, b, c], temporal_patch_size=1, return_tensors="np")["pixel_values"]
    video = torch.from_numpy(flat.reshape(3, h // m, w // m, m, m, 3, p, p).transpose(0, 5, 1, 3, 6, 2, 4, 7)
                             .reshape(1, 3, 3, h * p, w * p).copy())
    theirs, t, gh, gw = transformers_video_method("patchify")(None, video, patch_size=p, merge_size=m,
                                                            temporal_patch_size=ip.temporal_patch_size)
    assert [t, gh, gw] == grid3 == [2, h, w]
    assert torch.equal(theirs[0], torch.from_numpy(ours))


@pytest.mark.parametrize("total,video_fps,want", [(8, 4.0, {"fps": 2.0}), (300, 30.0, {"fps": 2.0}),
                                                  (300, 30.0, {"fps": 2.0, "max_frames": 12}),
                                                  (10, 5.0, {"nframes": 5}), (7, 30.0, {"fps": 2.0})])
def test_sampling_equals_transformers_sample_frames(total, video_fps, want):
    from transformers.video_utils import VideoMetadata

    from harness.data.video import DEFAULTS, sample_indices

    want = {**DEFAULTS, **want}
    self = SimpleNamespace(num_frames=None, fps=None, temporal_patch_size=2, min_frames=DEFAULTS["min_frames"],
                           max_frames=DEFAULTS["max_frames"])
    kwargs = {"num_frames": want["nframes"]} if "nframes" in want else {"fps": want["fps"]}
    theirs = transformers_video_method("sample_frames")(self, VideoMetadata(total_num_frames=total, fps=video_fps),
                                                         max_frames=want["max_frames"], **kwargs)
    assert sample_indices(total, video_fps, want, 2).tolist() == theirs.tolist()


def video_rows(folder, root: Path, store: Path, part_extra=None):
    """A chat file with a text record, a video (5 frames, padded to 6) + image record, and an image record."""
    from helpers.vl_models import write_chat
    from test_vision_language import rows_of

    data = root / "data"
    frames = write_frames(data / "clip", 5)
    path = write_chat(data / "video.jsonl", write_images(data / "img", 2), ["text", "video", "image"], frames=frames)
    if part_extra:
        lines = [json.loads(x) for x in Path(path).read_text().splitlines()]
        lines[1]["messages"][0]["content"][0].update(part_extra)
        Path(path).write_text("".join(json.dumps(x) + "\n" for x in lines))
    return rows_of(folder, path, store, packing="concat")


def grads_of(model, run):
    model.zero_grad(set_to_none=True)
    out = run()
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["qwen", "qwen25"])
def test_video_and_image_equal_transformers_forward(folders, family, tmp_path):
    """Record 2 (a 5-frame video, then an image): transformers' own forward with pixel_values_videos /
    video_grid_thw / second_per_grid_ts and pixel_values / image_grid_thw against the harness's, where the video and
    the image go through the tower in ONE call (and in 2 calls + a placeholder with max_images_per_call 1 ... 3):
    loss and every gradient equal within 1e-6, and the video's tokens really moved the loss."""
    from transformers import AutoModelForImageTextToText

    from harness.data.rows import loss_items
    from harness.data.video import IMAGE, VIDEO
    from harness.model import vision

    rows, lines = video_rows(folders[family], folders["root"] / family, tmp_path / "store", {"fps": 2.5})
    assert "3 conversations (2 with images, 2 images, 1 videos" in lines[0], lines
    row = next(i for i in range(len(rows)) if 2 in rows[i:i + 1].tensors()[2].kinds)  # rows hold whole conversations
    ids, labels, images = rows[row:row + 1].tensors()
    assert images.kinds == [VIDEO, IMAGE] and images.grids[0][0] == 3  # 5 frames -> 6 -> t 3
    assert images.seconds[0] == pytest.approx(2 / 2.5)
    model = AutoModelForImageTextToText.from_pretrained(folders[family], dtype=torch.float32)
    config = model.config
    types = (ids == config.image_token_id).int() + 2 * (ids == config.video_token_id).int()
    extra = {"second_per_grid_ts": torch.tensor(images.seconds[:1])} if family == "qwen25" else {}
    theirs, their_grads = grads_of(model, lambda: model(
        input_ids=ids, labels=labels, pixel_values=images.pixels[1], image_grid_thw=images.grids[1][None],
        pixel_values_videos=images.pixels[0], video_grid_thw=images.grids[0][None], mm_token_type_ids=types,
        use_cache=False, **extra))
    vision.install(model)
    for per_call, calls in ((8, 1), (3, 2), (1, 3)):
        assert vision.num_chunks(images, per_call) == min(calls, 2)
        ours, our_grads = grads_of(model, lambda: model(input_ids=ids, labels=labels, images=images, num_calls=calls,
                                                        per_call=per_call, use_cache=False,
                                                        num_items_in_batch=loss_items(labels)))
        assert abs(float(ours - theirs)) <= 1e-6, (per_call, float(ours), float(theirs))
        assert our_grads.keys() == their_grads.keys()
        worst = max(float((our_grads[n] - g).abs().max()) for n, g in their_grads.items())
        assert worst <= 1e-6, (per_call, worst)
        print(f"[video] {family} per_call {per_call}: |loss diff| {abs(float(ours - theirs)):.1e}, "
              f"max |grad diff| {worst:.1e}")
    # the time positions transformers' own forward computes (compute_3d_position_ids) equal the harness's; on
    # Qwen2.5-VL they follow the video's seconds per temporal patch (the loss of a random tiny model barely feels them)
    embeds = model.get_input_embeddings()(ids)
    model.model.rope_deltas = None
    want = model.model.compute_3d_position_ids(input_ids=ids, inputs_embeds=embeds, attention_mask=None, cache=None,
                                               image_grid_thw=images.grids[1][None],
                                               video_grid_thw=images.grids[0][None], mm_token_type_ids=types, **extra)
    assert torch.equal(vision.rope_positions(model, ids, images), want)
    slower = images.__class__(images.pixels, images.grids, [VIDEO, IMAGE], [images.seconds[0] * 4, 0.0])
    assert torch.equal(vision.rope_positions(model, ids, slower), want) == (family == "qwen")


def test_video_file_decoded_with_pyav_and_teaching_error_without(folders, tmp_path, monkeypatch):
    """An 8-frame 4 fps MPEG-4 (2 s) sampled at the default fps 2: frames 0, 2, 4, 6 (transformers' sampling), grid
    t 2, 1 s per temporal patch, the patches of exactly those decoded frames; with `import av` failing, a UsageError
    that names the file and the fix."""
    import av

    from harness.data.video import DEFAULTS, encode_video
    from harness.data.vision import open_image
    from harness.errors import UsageError

    write_mp4(tmp_path / "clip.mp4", 8, fps=4)
    ctx = SimpleNamespace(image_processor=processor(folders["qwen"]), base=tmp_path, video_defaults=dict(DEFAULTS))
    got = encode_video({"type": "video", "video": "clip.mp4"}, ctx, "r 1", open_image)
    with av.open(str(tmp_path / "clip.mp4")) as f:
        decoded = [x.to_ndarray(format="rgb24") for x in f.decode(video=0)]
    from harness.data.video import patches

    want, _ = patches(ctx.image_processor, [decoded[i] for i in (0, 2, 4, 6)], {})
    assert got.grid[0] == 2 and got.second_per_grid == pytest.approx(1.0) and np.array_equal(got.pixels, want)
    monkeypatch.setitem(__import__("sys").modules, "av", None)
    with pytest.raises(UsageError) as err:
        encode_video({"type": "video", "video": "clip.mp4"}, ctx, "r 1", open_image)
    assert "needs PyAV to be decoded" in str(err.value) and "pip install av" in str(err.value)


def test_frame_folder_thinned_to_max_frames_and_folder_defaults(folders, tmp_path):
    """A folder of 10 frames (name order) with max_frames 4 keeps frames 0, 2, 5, 7 (uniform, as sample_frames):
    the patches of exactly those frames, grid t 2, and fps 3 (the frames' rate) thinned by 4 / 10 -> 1.2 frames a
    second, 2 / 1.2 s per temporal patch. A video_preprocessor_config.json beside the model sets the defaults."""
    from harness.data.video import DEFAULTS, defaults_of, encode_video, patches
    from harness.data.vision import open_image

    paths = write_frames(tmp_path / "clip", 10)
    ctx = SimpleNamespace(image_processor=processor(folders["qwen"]), base=tmp_path, video_defaults=dict(DEFAULTS))
    got = encode_video({"type": "video", "video": "clip", "max_frames": 4, "fps": 3}, ctx, "r 1", open_image)
    want, grid = patches(ctx.image_processor, frames_of([paths[i] for i in (0, 2, 5, 7)]), {})
    assert got.grid == grid and grid[0] == 2 and np.array_equal(got.pixels, want)
    assert got.second_per_grid == pytest.approx(2 / 1.2)
    model = tmp_path / "model"
    model.mkdir()
    (model / "video_preprocessor_config.json").write_text(json.dumps(
        {"fps": 1.0, "max_frames": 16, "size": {"shortest_edge": 3136, "longest_edge": 50176}}))
    assert defaults_of(str(model)) == {"fps": 1.0, "min_frames": 4, "max_frames": 16, "min_pixels": 3136,
                                       "max_pixels": 50176}


def test_packed_row_with_videos_equals_its_conversations_one_per_row(folders, tmp_path):
    """Qwen2.5-VL, train.packing=document: a row packing text, video + image and image conversations gives the loss
    and every gradient of the same conversations one per row within 1e-5, and each conversation's 3-D positions in
    the row (time spaced by its video's seconds per temporal patch) are exactly those it has alone."""
    from helpers.vl_models import write_chat
    from test_vision_language import loss_and_grads, rows_of

    from harness.model import vision

    data = tmp_path / "data"
    path = write_chat(data / "video.jsonl", write_images(data / "img", 3), ["text", "video", "image", "video"],
                      frames=write_frames(data / "clip", 5))
    packed, lines = rows_of(folders["qwen25"], path, tmp_path / "packed", seq_len=400)
    assert "4 conversations (3 with images, 3 images, 2 videos" in lines[0] and "into 1 rows" in lines[0], lines
    alone, _ = rows_of(folders["qwen25"], path, tmp_path / "alone", seq_len=96, packing="concat")
    assert len(alone) == 4 and alone.records.tolist() == packed.records.tolist() == [1, 2, 3, 4]
    batch, single = packed.tensors(), alone.tensors()
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(folders["qwen25"], dtype=torch.float32)
    vision.install(model)
    calls = 5  # per_call 1: video, image, image, video, image; rows alone need no more
    loss, grads = loss_and_grads(model, batch, num_calls=calls)
    want, want_grads = loss_and_grads(model, single, num_calls=calls)
    worst = max([abs(float(loss - want))] + [float((grads[n] - g).abs().max()) for n, g in want_grads.items()
                                             if g is not None])
    assert worst <= 1e-5, worst
    rope = vision.rope_positions(model, batch[0], batch[2], batch[3])
    bounds = (batch[3][0] == 0).nonzero().flatten().tolist() + [batch[0].shape[1]]
    for i in (1, 2, 3):  # the conversations with a video or an image
        ids, _, images = alone[i:i + 1].tensors()
        lo, n = bounds[i], bounds[i + 1] - bounds[i]
        assert torch.equal(rope[1:, 0, lo:lo + n], vision.rope_positions(model, ids, images)[:, 0, :n]), i
    print(f"[video] packed Qwen2.5-VL row of 4 conversations (2 videos) vs one per row: worst |diff| {worst:.1e}")


@pytest.mark.parametrize("model_type,why", [("qwen3_vl", "deepstack features and timestamped frames"),
                                            ("llava", "takes images only")])
def test_video_refused_under_a_family_without_a_video_path(model_type, why, tmp_path):
    """Qwen3-VL (deepstack, timestamped frames) and image-only families refuse a video part before launch, with the
    reason and the fix (the LLaVA folder case runs through harness/run.py in tests/test_runtime_catalogue.py)."""
    from harness.errors import UsageError
    from harness.train.vision_checks import _video_problems

    ctx = SimpleNamespace(config=SimpleNamespace(model_type=model_type, video_token_id=7), name="/models/m")
    messages = [{"role": "user", "content": [{"type": "video", "video": ["f0.png"]}]}]
    with pytest.raises(UsageError) as err:
        _video_problems(messages, tmp_path, "data.jsonl record 1", ctx)
    said = str(err.value)
    assert f"record 1: a video part, but train.model /models/m ({model_type}) has no video path" in said
    assert why in said and "fix: train a Qwen2-VL or Qwen2.5-VL model for video" in said
