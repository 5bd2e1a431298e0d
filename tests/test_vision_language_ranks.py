"""Vision-language runs on real DeepSpeed ranks (issue 40), tiny random Qwen2-VL and LLaVA folders, fp32, SGD:
the data is laid out so that at every step rank 0's row is text only and rank 1's holds images (one, then two with
vision.max_images_per_call 1: two tower calls on rank 1, two placeholder calls on rank 0). ZeRO-3 (the case that
hangs with transformers' forward), ZeRO-2, ZeRO-3 with a frozen vision tower and ZeRO-3 with LoRA on the language
model and the projector finish, and their losses and grad norms equal a 1-rank run on the same global batch (1 micro
x 2 accumulation steps) within 1e-5, and so does ZeRO-3 where rank 1 reads a video (5 frames) and an image at each
step (2 tower calls: the video alone, 3 temporal patches over the cap of 1, then the image; rank 0 two placeholders),
and ZeRO-3 on packed rows (two conversations a row, positions and attention per conversation:
harness/data/vision_pack.py); the 2-rank ZeRO-3 checkpoint (AdamW), and the plain-SGD one,
resume on 1 rank exactly; its export loads with
transformers' own class and image processor, with logits equal to the engine's (the probe) and, on an image
conversation, transformers' own forward (pixel_values) equal to the harness's; the LoRA run's merged export loads with
transformers' own class and equals peft's base + adapter on an image conversation. Two launches: every 2-rank case,
then every 1-rank case and the resume."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch

from harness.cli import main
from helpers.launch import launch_jobs, records
from helpers.vl_models import llava_folder, qwen2_vl_folder, write_chat, write_frames, write_images

STEPS, ROWS, SEED, TOL = 2, 8, 1234, 1e-5
PACKED_SEQ_LEN = 140  # two conversations a row (each is 50-70 tokens): 4 packed rows; step 1 gives rank 0 a text-only
# row and rank 1 a row with 2 images, step 2 one image each (harness/data/vision_pack.py packs in record order)
CASES = [("qwen_zero3", "qwen", "zero3", []), ("qwen_zero2", "qwen", "zero2", []),
         ("qwen_zero3_frozen_vision", "qwen", "zero3", ["--set", 'vision.freeze=["vision"]']),
         ("llava_zero3", "llava", "zero3", []), ("llava_zero2", "llava", "zero2", []),
         ("qwen_zero3_lora", "qwen", "zero3", ["--set", "adapter.type=lora", "--set", "adapter.r=4",
                                               "--set", 'vision.lora=["language","projector"]']),
         ("qwen_zero3_packed", "qwen", "zero3", ["--set", f"train.seq_len={PACKED_SEQ_LEN}"]),
         ("qwen_video_zero3", "qwen", "zero3", [])]
DATA = {"qwen_video_zero3": "chat_video.jsonl"}  # rank 1 reads a 5-frame video + an image at each step
# resumed on 1 rank: AdamW, and plain SGD (qwen_zero3: no optimizer state, which DeepSpeed's universal conversion
# cannot read alone; harness/checkpoint/moments.py fills in Adam's moments for it and drops them after the load)
RESUMED = ("qwen_zero3_adamw", "qwen", "zero3", ["--set", "optimizer.type=adamw", "--set", "optimizer.lr=0.001"])


def split_kinds() -> list[str]:
    """Record kinds such that, on 2 ranks (1 row each per step), rank 0 reads text and rank 1 images."""
    from harness.data.batches import BatchPlan

    plan = BatchPlan(num_rows=ROWS, global_batch=2, micro_batch=1, grad_accum=1, dp_rank=0, dp_size=2, seed=SEED)
    kinds = ["text", "image"] * (ROWS // 2)
    for step in range(STEPS):
        text, image = plan.global_rows(step).tolist()
        kinds[text], kinds[image] = "text", ("image" if step == 0 else "two")
    return kinds


def argv(root: Path, name: str, family: str, recipe: str, extra: list, ranks: int) -> list[str]:
    sets = {"train.model": root / family, "train.dataset": root / "data" / DATA.get(name, "chat.jsonl"),
            "train.format": "chat",
            "train.seq_len": 96, "train.steps": STEPS, "precision": "fp32", "batch.micro_batch_per_gpu": 1,
            "batch.grad_accum_steps": 3 - ranks, "batch.train_batch_size": '"auto"', "train.seed": SEED,
            "train.store_dir": root / "stores", "train.eval_fraction": 0, "optimizer.type": "sgd",
            "optimizer.lr": 0.5, "optimizer.weight_decay": 0, "gradient_clipping": 0, "scheduler.type": "none",
            "train.log_every": 1, "train.save_every": 1, "vision.max_images_per_call": 1}
    out = ["--recipe", recipe, "--output-dir", str(root / f"{name}_r{ranks}")]
    for key, value in sets.items():
        out += ["--set", f"{key}={value}"]
    return out + extra


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    root = tmp_path_factory.mktemp("vl_ranks")
    qwen2_vl_folder(root / "qwen"), llava_folder(root / "llava")
    images = write_images(root / "data" / "img", 5)
    write_chat(root / "data" / "chat.jsonl", images, split_kinds())
    write_chat(root / "data" / "chat_video.jsonl", images, [k if k == "text" else "video" for k in split_kinds()],
               frames=write_frames(root / "data" / "clip", 5))
    two = [argv(root, *case, ranks=2) for case in [*CASES, RESUMED]]
    resume = argv(root, *RESUMED, ranks=1)
    resume[resume.index("--output-dir") + 1] = str(root / "resumed")
    resume += ["--resume", str(root / "qwen_zero3_adamw_r2" / "checkpoints" / "global_step1")]
    sgd = []  # plain SGD through the universal form (harness/checkpoint/moments.py); ZeRO-2's own file layout was
    for case in CASES[:1]:  # checked by hand (docs/vision-language.md): CASES[:2] adds it, ~4.4 s
        sgd.append(argv(root, *case, ranks=1))
        sgd[-1][sgd[-1].index("--output-dir") + 1] = str(root / f"resumed_{case[0]}")
        sgd[-1] += ["--resume", str(root / f"{case[0]}_r2" / "checkpoints" / "global_step1")]
    start = time.perf_counter()
    launch_jobs(two, root, ranks=2, timeout_s=900)
    middle = time.perf_counter()
    launch_jobs([argv(root, *case, ranks=1) for case in CASES] + [resume, *sgd], root, ranks=1, timeout_s=900)
    return root, {"2 ranks": middle - start, "1 rank": time.perf_counter() - middle}


def _close(what: str, got: float, want: float) -> float:
    assert got is not None and want is not None, f"{what}: {got} vs {want}"
    assert abs(got - want) <= TOL * max(1.0, abs(want)), f"{what}: {got} vs {want}"
    return abs(got - want)


@pytest.mark.multirank
def test_text_only_rank_and_image_rank_match_one_rank(launched):
    root, seconds = launched
    worst = 0.0
    for name, *_ in CASES:
        two, one = records(root / f"{name}_r2", "train"), records(root / f"{name}_r1", "train")
        assert len(two) == len(one) == STEPS, name
        for step, (a, b) in enumerate(zip(two, one), start=1):
            worst = max(worst, _close(f"{name} step {step} loss", a["loss"], b["loss"]),
                        _close(f"{name} step {step} grad_norm", a["grad_norm"], b["grad_norm"]))
        assert two[1]["loss"] != two[0]["loss"]  # the update moved the weights
    packed = [json.loads(m.read_text()) for m in (root / "stores").glob("vision-*/meta.json")]
    assert [(m["rows"], m["conversations"]) for m in packed if m["seq_len"] == PACKED_SEQ_LEN] == [(4, ROWS)], packed
    videos = [m for m in packed if m.get("videos")]  # one conversation a row: rank 0 reads text only
    want = sum(kind != "text" for kind in split_kinds())
    assert [(m["rows"], m["conversations"], m["videos"]) for m in videos] == [(ROWS, ROWS, want)], videos
    frozen, full = records(root / "qwen_zero3_frozen_vision_r2", "train"), records(root / "qwen_zero3_r2", "train")
    assert frozen[0]["loss"] == pytest.approx(full[0]["loss"], abs=1e-6)  # same weights at step 1
    assert frozen[0]["grad_norm"] < full[0]["grad_norm"]  # the tower's gradient is not part of it
    print(f"[vl] worst |2 ranks - 1 rank| over loss and grad norm: {worst:.2e}; launches {seconds}")


@pytest.mark.multirank
def test_resume_on_one_rank_continues_exactly(launched):
    root, _ = launched
    two, resumed = records(root / "qwen_zero3_adamw_r2", "train"), records(root / "resumed", "train")
    assert [r["step"] for r in resumed] == [2]
    _close("resumed step 2 loss", resumed[0]["loss"], two[1]["loss"])
    _close("resumed step 2 grad_norm", resumed[0]["grad_norm"], two[1]["grad_norm"])


def image_inputs(folder: Path, root: Path, config) -> dict:
    """An image conversation of the data as transformers' own classes prepare it: the tokenizer's chat template,
    the image processor's pixels, the image token repeated once per merged patch."""
    from transformers import AutoImageProcessor, AutoTokenizer

    from harness.data.vision import open_image

    processor, tokenizer = AutoImageProcessor.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    record = next(json.loads(line) for line in (root / "data" / "chat.jsonl").read_text().splitlines()
                  if '"image"' in line)
    text = tokenizer.apply_chat_template(record["messages"], tokenize=False)
    image = open_image(record["messages"][0]["content"][0]["image"], root / "data", "test")
    pixels = processor(images=[image], return_tensors="pt")
    merge = config.vision_config.spatial_merge_size ** 2
    text = text.replace("<|image_pad|>", "<|image_pad|>" * int(pixels["image_grid_thw"].prod() // merge))
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    return {"input_ids": ids, "pixel_values": pixels["pixel_values"], "image_grid_thw": pixels["image_grid_thw"],
            "mm_token_type_ids": (ids == config.image_token_id).int()}


@pytest.mark.multirank
@pytest.mark.parametrize("name", ["qwen_zero3"])
def test_plain_sgd_resumes_through_the_universal_form(launched, name):
    """Plain SGD keeps no state: ds_to_universal alone fails (KeyError 0 on exp_avg); the harness fills the moments
    and a step in for the conversion, and the resumed engine's next checkpoint holds no optimizer tensors again."""
    from harness.checkpoint.moments import INJECTED

    root, _ = launched
    two, resumed = records(root / f"{name}_r2", "train"), records(root / f"resumed_{name}", "train")
    assert [r["step"] for r in resumed] == [2]
    _close(f"{name} sgd resumed step 2 loss", resumed[0]["loss"], two[1]["loss"])
    _close(f"{name} sgd resumed step 2 grad_norm", resumed[0]["grad_norm"], two[1]["grad_norm"])
    universal = root / f"{name}_r2" / "checkpoints" / "universal" / "global_step1"
    assert json.loads((universal / INJECTED).read_text()) == ["exp_avg", "exp_avg_sq", "step"]
    saved = next((root / f"resumed_{name}" / "checkpoints" / "global_step2").glob("*optim_states.pt"))
    state = torch.load(saved, map_location="cpu", weights_only=False)["optimizer_state_dict"]
    state = state["optimizer_state_dict" if "fp32_flat_groups" in state else "base_optimizer_state"]["state"]
    assert all(not entry for entry in state.values()), "the filled-in moments outlived the load"


@pytest.mark.multirank
def test_export_loads_with_transformers_class_and_processor(launched, tmp_path, capsys):
    from transformers import Qwen2VLForConditionalGeneration

    from harness.model import vision

    root, _ = launched
    out = tmp_path / "export"
    assert main(["export", str(root / "qwen_zero3_r2"), "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "max |logit diff| 0.00e+00" in said and "AutoModelForImageTextToText" in said, said
    model = Qwen2VLForConditionalGeneration.from_pretrained(out, dtype=torch.float32).eval()
    inputs = image_inputs(out, root, model.config)
    with torch.no_grad():
        theirs = model(**inputs).logits
        vision.install(model)
        ours = model(input_ids=inputs["input_ids"], images=vision.Images([inputs["pixel_values"]],
                     [inputs["image_grid_thw"][0]]), num_calls=1).logits
    assert torch.allclose(theirs, ours, atol=1e-5, rtol=0), float((theirs - ours).abs().max())


@pytest.mark.multirank
def test_merged_lora_export_loads_with_transformers_class(launched, tmp_path, capsys):
    """The 2-rank ZeRO-3 LoRA run (language model + projector): `harness export` merges the adapters into the
    base (W + s B A, the folder's keys read under transformers' renamings) and checks the text probe against the
    engine's logits; on an image conversation, transformers' own class on the merged folder equals peft's base +
    adapter (the adapter-only export), so the projector's merged adapters are right too."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import Qwen2VLForConditionalGeneration

    root, _ = launched
    run, merged, adapter = root / "qwen_zero3_lora_r2", tmp_path / "merged", tmp_path / "adapter"
    assert main(["export", str(run), "--out", str(merged)]) == 0
    said = capsys.readouterr().out
    assert main(["export", str(run), "--out", str(adapter), "--adapter-only"]) == 0
    said += capsys.readouterr().out
    diffs = [float(d) for d in re.findall(r"max \|logit diff\| ([0-9.e+-]+)", said)]
    assert len(diffs) == 2 and max(diffs) <= 1e-5, said
    model = Qwen2VLForConditionalGeneration.from_pretrained(merged, dtype=torch.float32).eval()
    base = Qwen2VLForConditionalGeneration.from_pretrained(root / "qwen", dtype=torch.float32)
    tensors = load_file(adapter / "adapter_model.safetensors")
    projector = [k for k in tensors if ".merger." in k and ".lora_B." in k]
    assert len(projector) == 2 and all(torch.count_nonzero(tensors[k]) for k in projector), sorted(tensors)
    assert not torch.equal(model.model.visual.merger.mlp[0].weight, base.model.visual.merger.mlp[0].weight)
    peft = PeftModel.from_pretrained(base, adapter).eval()
    inputs = image_inputs(merged, root, model.config)
    with torch.no_grad():
        ours, theirs = model(**inputs).logits, peft(**inputs).logits
    worst = float((ours - theirs).abs().max())
    assert worst <= 1e-5, worst
    print(f"[vl] merged LoRA export: probe |logit diff| {diffs}; image conversation merged vs peft {worst:.2e}")
