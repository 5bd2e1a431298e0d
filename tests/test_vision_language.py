"""Vision-language models (issue 40) on tiny random Qwen2-VL and LLaVA folders built from transformers' own config
classes (tests/helpers/vl_models.py), without DeepSpeed ranks: the placeholder vision call adds exactly zero to the
loss and to every gradient, bit for bit; the store keeps each conversation's image tokens with its images; the
planner's vision / projector / language parameter counts equal the live model's; the planner's vision activations
equal what autograd keeps on the live model (trained, frozen tower, all frozen) and move the plan's first fit. The
multi-rank cases (ZeRO-2/3 with a text-only rank 0 and an images-only rank 1 against one rank, frozen tower, resume
2 -> 1, export) are in tests/test_vision_language_ranks.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers.vl_models import llava_folder, qwen2_vl_folder, write_chat, write_images


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("vl")
    images = write_images(root / "data" / "img", 4)
    data = write_chat(root / "data" / "chat.jsonl", images, ["text", "image", "two", "image"])
    return {"qwen": qwen2_vl_folder(root / "qwen"), "llava": llava_folder(root / "llava"), "data": data,
            "root": root}


def rows_of(folder: str, data: str, store: Path):
    """The vision store's rows for a chat file, as a run prepares them (train/vision_steps.load_data)."""
    from harness.train.vision_steps import load_data

    recipe = {"train": {"model": folder, "dataset": data, "format": "chat", "seq_len": 96, "store_dir": str(store),
                        "eval_fraction": 0, "seed": 0, "messages_field": "messages"}}
    from harness.model.hf import load_tokenizer

    train, _, lines = load_data(SimpleNamespace(recipe=recipe), SimpleNamespace(local_rank=0), load_tokenizer(folder))
    return train, lines


def model_of(folder: str):
    from transformers import AutoModelForImageTextToText

    from harness.model import vision

    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    vision.install(model)
    return model


def loss_and_grads(model, batch, num_calls: int):
    from harness.data.rows import loss_items

    model.zero_grad(set_to_none=True)
    ids, labels, images = batch
    loss = model(input_ids=ids, labels=labels, images=images, num_calls=num_calls, per_call=1, use_cache=False,
                 num_items_in_batch=loss_items(labels)).loss
    loss.backward()
    return loss.detach(), {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()}


@pytest.mark.parametrize("family", ["qwen", "llava"])
def test_placeholder_adds_exactly_zero(folders, family, tmp_path):
    """A text-only row with one placeholder call against the same row with no vision call at all, and an image
    row with its calls against the same row with two extra placeholder calls: loss and every gradient equal bit
    for bit; the placeholder leaves the vision tower a gradient of exact zeros (so ZeRO reduces it everywhere)."""
    from harness.planner.vision import family_of

    rows, _ = rows_of(folders[family], folders["data"], tmp_path / "store")
    model = model_of(folders[family])
    text, image = rows[0:1].tensors(), rows[2:3].tensors()  # record 2 holds two images
    assert len(text[2]) == 0 and len(image[2]) == 2
    real, real_grads = loss_and_grads(model, image, num_calls=2)
    padded, padded_grads = loss_and_grads(model, image, num_calls=4)
    assert torch.equal(real, padded)
    assert all(torch.equal(real_grads[n], padded_grads[n]) for n in real_grads if real_grads[n] is not None)
    bare, bare_grads = loss_and_grads(model, text, num_calls=0)
    held, held_grads = loss_and_grads(model, text, num_calls=1)
    assert torch.equal(bare, held)
    part = family_of(model.config.model_type).part_of
    for name, grad in held_grads.items():
        if bare_grads[name] is not None:
            assert torch.equal(grad, bare_grads[name]), name
            continue
        assert part(name) in ("vision", "projector"), name
        if real_grads[name] is None:  # unused by the family's forward (LLaVA: CLIP's post_layernorm): never a grad
            assert grad is None, name
        else:
            assert torch.count_nonzero(grad) == 0, f"{name}: the placeholder left a non-zero gradient"
    vision_grads = [g for n, g in real_grads.items() if part(n) == "vision" and g is not None]
    assert vision_grads and any(torch.count_nonzero(g) for g in vision_grads)  # real images do train the tower


@pytest.mark.parametrize("family", ["qwen", "llava"])
def test_store_keeps_image_tokens_with_their_images(folders, family, tmp_path):
    """Each row's image tokens equal the features its images give, no image token is a loss target, and the
    loss covers exactly the assistant turns."""
    from harness.model import vision

    rows, lines = rows_of(folders[family], folders["data"], tmp_path / "store")
    assert "4 conversations (3 with images, 4 images" in lines[0], lines
    model = model_of(folders[family])
    token = vision.image_token_id(model.config)
    for i in range(len(rows)):
        ids, labels, images = rows[i:i + 1].tensors()
        if len(images):
            with torch.no_grad():
                feats = [vision.image_features(model, p, None if not images.grids else g.unsqueeze(0))
                         for p, g in zip(images.pixels, images.grids or [None] * len(images))]
            assert int((ids == token).sum()) == sum(f.shape[0] for f in feats)
        assert not bool(((ids == token) & (labels != -100)).any())
        assert int((labels != -100).sum()) > 0


@pytest.mark.parametrize("family", ["qwen", "llava"])
def test_planner_part_counts_equal_the_live_model(folders, family):
    from harness.model_shapes import load_model_config
    from harness.planner.params import count_params
    from harness.planner.vision import meta_parts, parts_count

    cfg = load_model_config(folders[family])
    model = model_of(folders[family])
    live = parts_count(model.named_parameters(), model.config.model_type)
    assert meta_parts(cfg) == live
    assert count_params(cfg).total == sum(live.values()) == sum(p.numel() for p in model.parameters())
    assert live["vision"] > 0 and live["projector"] > 0 and live["language"] > 0


@pytest.mark.parametrize("family", ["qwen", "llava"])
def test_lora_goes_on_the_language_model_not_the_tower(folders, family, tmp_path):
    """adapter.type=lora on a vision-language model: adapters on the language model's projections only (a CLIP
    tower's q_proj / v_proj match the default suffixes), and the harness's forward still runs through them."""
    from harness.config.recipes import load_recipe
    from harness.model import adapters
    from harness.planner.vision import family_of

    recipe = load_recipe("lora_zero2", [])[0]
    model = adapters.apply(model_of(folders[family]), recipe)
    part = family_of(model.config.model_type).part_of
    lora = [n for n, _ in model.named_parameters() if ".lora_A." in n]
    assert lora and {part(n) for n in lora} == {"language"}, lora
    rows, _ = rows_of(folders[family], folders["data"], tmp_path / "store")
    loss, grads = loss_and_grads(model, rows[1:2].tensors(), num_calls=1)
    assert torch.isfinite(loss) and all(g is not None for n, g in grads.items() if ".lora_B." in n)


def test_plan_counts_the_tower_image_tokens_and_what_freezing_saves(folders, capsys):
    """`harness plan --images-per-sample 2 --image-size 224x224`: the parts' counts equal the live model's, 2 x 64
    image tokens (224 / 28 = 8 merged patches a side), freezing a part saves its gradient + fp32 master + Adam
    states (2 + 4 x 3 = 14 B/param in bf16), per rank / 2 GPUs."""
    import json

    from harness.cli import main
    from harness.planner.vision import parts_count

    assert main(["plan", "--model", folders["qwen"], "--gpus", "2", "--gpu-mem", "80GB", "--images-per-sample", "2",
                 "--image-size", "224x224", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)["model"]["vision"]
    model = model_of(folders["qwen"])
    live = parts_count(model.named_parameters(), model.config.model_type)
    assert info["params"] == live
    assert info["image_tokens_per_sample"] == 2 * 64
    assert info["freeze_saves_bytes"] == {part: 14 * n for part, n in live.items()}
    assert info["freeze_saves_bytes_per_rank"]["vision"] == 14 * live["vision"] // 2
    assert main(["plan", "--model", folders["qwen"], "--gpus", "2", "--gpu-mem", "80GB", "--image-size", "big"]) == 2
    assert "--image-size 'big': give HEIGHTxWIDTH" in capsys.readouterr().err


def saved_bytes(model, images, per_call: int) -> int:
    """Bytes autograd keeps for backward from the vision calls of one micro-batch (distinct storages, parameters
    left out): what a live run holds from the tower and projector until backward."""
    from harness.model import vision

    kept, weights = {}, {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):  # the features kept: their graphs alive
        features = [vision.image_features(model, pixels, grid) for pixels, grid in images.chunks(per_call)]
    assert len(features) == -(-len(images) // per_call)
    return sum(n for ptr, n in kept.items() if ptr not in weights)


@pytest.mark.parametrize("family", ["qwen", "llava"])
def test_planner_vision_activations_equal_what_autograd_keeps(folders, family):
    """planner/vision.activation_bytes' saved bytes against the tensors autograd saves on the live model (fp32,
    3 images in calls of 2): trained tower and frozen tower (the projector alone) within 5 % (rotary tables and
    attention's logsumexp left out), all frozen exactly nothing: a frozen tower keeps no activations."""
    import json

    from harness.data.vision import Images
    from harness.model.vision import freeze
    from harness.planner.vision import activation_bytes, vision_load

    cfg = json.loads((Path(folders[family]) / "config.json").read_text())
    side = 112 if family == "qwen" else 28
    load = vision_load(cfg, 3, side, side)
    if family == "qwen":
        images = Images([torch.randn(load.patches, load.pixel_elems) for _ in range(3)],
                        [torch.tensor([1, side // 14, side // 14])] * 3)
    else:
        images = Images([torch.randn(1, 3, side, side) for _ in range(3)], [])
    bounds = {(): (0.95, 1.05), ("vision",): (0.95, 1.05)}  # the kernels' own extras vary with torch's state
    for parts in ((), ("vision",), ("vision", "projector")):
        model = model_of(folders[family])
        freeze(model, parts)
        got = saved_bytes(model, images, per_call=2)
        want = activation_bytes(vision_load(cfg, 3, side, side, parts, per_call=2), 1, 4)["saved"]
        if parts in bounds:
            low, high = bounds[parts]
            assert low <= want / got <= high, (family, parts, want, got)
        else:
            assert got == want == 0, (family, parts, got)


def test_images_enter_every_layouts_activations_and_move_the_fit(folders):
    """The plan's activations of every layout it walks are the language model's plus the vision term (saved +
    the larger of the transient and the language model's), and a budget that fits ddp without images does not
    with 8 images per sample of 448x448: the first fit moves."""
    from harness.model_shapes import load_model_config
    from harness.planner import plan
    from harness.planner.inputs import Cluster, Workload
    from harness.planner.memory import activation_bytes as lm_bytes
    from harness.planner.params import model_shape
    from harness.planner.vision import activation_bytes, vision_load

    cfg = load_model_config(folders["qwen"])  # as `harness plan` reads it
    load = vision_load(cfg, 8, 448, 448, per_call=2)
    text, images = Workload(seq_len=96, precision="fp32"), Workload(seq_len=96, precision="fp32", vision=load)
    term = activation_bytes(load, 1, 4)
    base = lm_bytes(model_shape(cfg), text)["total"]
    assert term["saved"] > 0 and term["transient"] > 0
    assert lm_bytes(model_shape(cfg), images)["total"] == term["saved"] + max(base, term["transient"])
    roomy = Cluster(1, 10**9)
    without, with_images = plan(cfg, roomy, text), plan(cfg, roomy, images)
    for a, b in zip(without.candidates, with_images.candidates):
        if b.get("applicable", True) and "memory" in b:
            grew = b["memory"]["activations"]["total"] - a["memory"]["activations"]["total"]
            assert grew > 0, b["label"]
    ddp = next(r for r in without.candidates if r["label"] == "ddp")["memory"]["gpu_bytes"]
    budget = int((ddp + term["saved"] // 2) / 0.9)  # ddp fits with room for half the images' activations
    tight = Cluster(1, budget)
    assert plan(cfg, tight, text).recommended["label"] == "ddp"
    moved = plan(cfg, tight, images)
    assert moved.recommended is None or moved.recommended["label"] != "ddp"
    ddp_images = next(r for r in moved.candidates if r["label"] == "ddp")
    assert not ddp_images["fits"] and "activations" in ddp_images["why_not"], ddp_images["why_not"]
