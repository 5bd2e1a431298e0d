"""Vision-language runs through the harness: per-rank memory beside the planner, and images/s with the vision tower
trained and frozen (vision.freeze=["vision"]), side by side in one invocation.

    python bench/vlm.py [--size tiny|small] [--ranks 2] [--recipe zero3] [--steps 12] [--warmup-steps 2]
                        [--records 64] [--image-size 224] [--video-frames 0] [--keep DIR]

Per run: a Qwen2-VL folder of the chosen size (transformers' own config class, seeded random weights, the shipped
tokenizer + the image tokens, the PIL image processor), a chat JSONL where every other record has one image of
--image-size pixels (the rest text only, so a rank regularly has none: the placeholder call runs), then
harness/run.py with vision.freeze [] and ["vision"], and once more with the tower trained on the same records
without their images (every call a placeholder). Reported from the runs' own files: the peak per rank the
profiling hook measured (GPU: max allocated; CPU ranks: RssAnon less malloc's free memory) beside the planner's
prediction for that rank (summary.json memory.predicted...), model states per rank, and images/s over the steps after
the warm-up (images in the step's rows / step time). With --video-frames N, each image record also holds a video of N
frames (a frame list, --image-size pixels; harness/data/video.py) before its image, through the same tower calls,
and video frames/s is reported beside images/s. Everything goes under a temporary folder deleted at the end
(unless --keep). On CPU ranks the measured peak includes each process's own heap (Python, torch: hundreds of MB), so
the memory ratio says something only where the model dominates, or on GPUs (bench/gpu_check.sh's vlm case); the
differences between the runs (images vs text only, tower trained vs frozen) are set beside the predicted ones.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from overhead import deepspeed, fail  # noqa: E402  the same launch and environment as bench/overhead.py

SIZES = {  # name: (text config fields, vision config fields, seq_len)
    "tiny": (dict(hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2), dict(depth=4, embed_dim=128, hidden_size=128, num_heads=4), 512),
    "small": (dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=12, num_attention_heads=14,
                   num_key_value_heads=2), dict(depth=16, embed_dim=640, hidden_size=896, num_heads=10), 1024),
}


def write_model(folder: Path, size: str) -> None:
    """A Qwen2-VL of `size` written like tests/helpers/vl_models.qwen2_vl_folder (mrope sections scaled)."""
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from helpers.vl_models import QWEN_TEMPLATE, QWEN_TOKENS, VOCAB, _tokenizer

    text, vision, seq = SIZES[size]
    tok = _tokenizer(QWEN_TOKENS, QWEN_TEMPLATE)
    ids = tok.convert_tokens_to_ids(QWEN_TOKENS)
    half = text["hidden_size"] // text["num_attention_heads"] // 2
    section = [half - 2 * (half * 3 // 8), half * 3 // 8, half * 3 // 8]
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=VOCAB, max_position_embeddings=4 * seq, bos_token_id=tok.eos_token_id,
                         eos_token_id=tok.eos_token_id, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                                         "mrope_section": section}, **text),
        vision_config=dict(mlp_ratio=4, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
                           **vision),
        vision_start_token_id=ids[0], vision_end_token_id=ids[1], image_token_id=ids[2], video_token_id=ids[3])
    torch.manual_seed(0)
    Qwen2VLForConditionalGeneration(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=1024 * 28 * 28).save_pretrained(folder)


def write_data(folder: Path, records: int, image_size: int, video_frames: int = 0) -> Path:
    import numpy as np
    from PIL import Image

    from helpers.vl_models import write_chat

    (folder / "img").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    images = []
    for i in range(8):
        path = folder / "img" / f"{i}.png"
        Image.fromarray(rng.integers(0, 255, (image_size, image_size, 3), dtype=np.uint8)).save(path)
        images.append(str(path))
    from helpers.vl_models import write_frames

    frames = write_frames(folder / "clip", video_frames, size=(image_size, image_size)) if video_frames else None
    kind = "video" if video_frames else "image"
    write_chat(folder / "text.jsonl", images, ["text"] * records)  # the same run without images (placeholder calls)
    return Path(write_chat(folder / "chat.jsonl", images, [kind, "text"] * (records // 2), frames=frames))


def run(args, model: Path, data: Path, out: Path, frozen: bool) -> dict:
    seq = SIZES[args.size][2]
    proc = deepspeed(args.ranks, "harness/run.py", "--recipe", args.recipe, "--output-dir", str(out),
                     "--set", f"train.model={model}", "--set", f"train.dataset={data}", "--set", "train.format=chat",
                     "--set", f"train.seq_len={seq}", "--set", f"train.steps={args.steps}", "--set",
                     "train.eval_every=0", "--set", "train.save_every=0", "--set", "train.log_every=1",
                     "--set", "train.eval_fraction=0", "--set", f"train.store_dir={out.parent / 'stores'}",
                     "--set", "vision.freeze=" + json.dumps(["vision"] if frozen else []))
    if not (out / "summary.json").is_file():
        raise fail(proc)
    summary = json.loads((out / "summary.json").read_text())
    train = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]
    timed = train[args.warmup_steps:]
    rows_per_step = train[0]["samples_per_s"] * train[0]["step_time_s"]
    if data.name == "text.jsonl":  # the run without images: every tower call a placeholder
        images_per_step = videos_per_step = 0.0
    else:
        store = next(m for m in map(json.loads, map(Path.read_text, (out.parent / "stores").glob("vision-*/meta.json")))
                     if m["seq_len"] == seq and m["images"])
        videos = store.get("videos", 0)  # the store counts a video among its "images" (harness/data/vision_store.py)
        images_per_step = rows_per_step * (store["images"] - videos) / store["rows"]  # packed rows: convs x images each
        videos_per_step = rows_per_step * videos / store["rows"]
    seconds = sum(r["step_time_s"] for r in timed)
    memory = summary["memory"]
    return {"images_per_s": images_per_step * len(timed) / seconds, "steps_timed": len(timed),
            "video_frames_per_s": videos_per_step * args.video_frames * len(timed) / seconds,
            "peak_per_rank": [p.get("peak_in_use_bytes") for p in memory["peak_per_rank"]],
            "predicted_peak_per_rank": memory.get("predicted_peak_total_per_rank"),
            "model_states_per_rank": memory["model_states_per_rank"][0],
            "predicted_activations": {k: (memory.get("predicted") or {}).get("activations", {}).get(k)
                                      for k in ("vision_saved", "vision_transient", "total")}}


def deltas(results: dict) -> list[str]:
    """Measured against predicted differences between the runs, per rank: images vs text only (the same model
    states: the images' activations alone), trained tower vs frozen (its activations and model states). On CPU ranks
    the absolute peaks carry each process's heap; their differences do not."""
    out = []
    for a, b in (("trained", "text"), ("trained", "frozen")):
        if a in results and b in results:
            got = [x - y for x, y in zip(results[a]["peak_per_rank"], results[b]["peak_per_rank"])]
            want = [x - y for x, y in zip(results[a]["predicted_peak_per_rank"], results[b]["predicted_peak_per_rank"])]
            out.append(f"[vlm] {a} - {b}: measured {[f'{g / 2**20:.1f} MiB' for g in got]}, predicted "
                       f"{[f'{w / 2**20:.1f} MiB' for w in want]}, predicted / measured "
                       f"{[round(w / g, 2) if g else None for w, g in zip(want, got)]}")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=tuple(SIZES), default="tiny")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--recipe", default="zero3")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--records", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--video-frames", type=int, default=0, help="a video of this many frames in each image record")
    parser.add_argument("--keep", type=Path)
    args = parser.parse_args(argv)
    root = args.keep or Path(tempfile.mkdtemp(prefix="bench_vlm_"))
    try:
        write_model(root / "model", args.size)
        data = write_data(root / "data", args.records, args.image_size, args.video_frames)
        results = {name: run(args, root / "model", data, root / name, frozen)
                   for name, frozen in (("trained", False), ("frozen", True))}
        results["text"] = run(args, root / "model", data.with_name("text.jsonl"), root / "text", False)
        for name, r in results.items():
            video = f" + {r['video_frames_per_s']:.2f} video frames/s" if args.video_frames else ""
            print(f"[vlm] {args.size} {args.recipe} x{args.ranks} vision {name}: {r['images_per_s']:.2f} images/s{video}; "
                  f"peak per rank {[f'{b / 2**20:.0f} MiB' for b in r['peak_per_rank'] if b]}, planner "
                  f"{r['predicted_peak_per_rank']}; model states rank 0 {r['model_states_per_rank']}")
        print("\n".join(deltas(results)))
        ratio = results["frozen"]["images_per_s"] / results["trained"]["images_per_s"]
        print(f"[vlm] images/s frozen / trained = {ratio:.2f}")
        print(json.dumps(results, indent=2, default=str))
        return 0
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
