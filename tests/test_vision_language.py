"""Vision-language models (issue 40) on tiny random Qwen2-VL, Qwen3-VL, LLaVA and Gemma 3 folders built from
transformers' own config classes (tests/helpers/vl_models.py), without DeepSpeed ranks: the placeholder vision call adds
exactly zero to the loss and to every gradient, bit for bit; Qwen3-VL's loss and gradients (deepstack features
included) equal transformers' own forward; the store keeps each conversation's image tokens with its images; the
planner's vision / projector / language parameter counts equal the live model's; the planner's vision activations
equal what autograd keeps on the live model (trained, frozen tower, all frozen) and move the plan's first fit; LoRA
goes on the parts vision.lora names; Gemma 3's rows and forward equal its own processor's and transformers' forward; an HF dataset's Image column
stores the pixels the same images as files give. The multi-rank cases (ZeRO-2/3 with
a text-only rank 0 and an images-only rank 1 against one rank, frozen tower, resume 2 -> 1, export) are in
tests/test_vision_language_ranks.py."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers.vl_models import gemma3_folder, llava_folder, qwen2_vl_folder, qwen3_vl_folder, write_chat, write_images


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("vl")
    images = write_images(root / "data" / "img", 4)
    data = write_chat(root / "data" / "chat.jsonl", images, ["text", "image", "two", "image"])
    return {"qwen": qwen2_vl_folder(root / "qwen"), "llava": llava_folder(root / "llava"),
            "gemma": gemma3_folder(root / "gemma"), "qwen3": qwen3_vl_folder(root / "qwen3"), "data": data,
            "root": root}


def rows_of(folder: str, data: str, store: Path, seq_len: int = 96, packing: str = "document"):
    """The vision store's rows for a chat file, as a run prepares them (train/vision_steps.load_data)."""
    from harness.train.vision_steps import load_data

    recipe = {"train": {"model": folder, "dataset": data, "format": "chat", "seq_len": seq_len, "store_dir": str(store),
                        "eval_fraction": 0, "seed": 0, "messages_field": "messages",
                        "packing": packing}}
    from harness.model.hf import load_tokenizer

    train, _, lines = load_data(SimpleNamespace(recipe=recipe), SimpleNamespace(local_rank=0), load_tokenizer(folder))
    return train, lines


def before_launch(folder: str, data: str, sets: list[str]) -> list:
    """The vision-language checks a run makes before any rank starts (train/vision_checks.py)."""
    from harness.config.recipes import load_recipe
    from harness.model_shapes import load_model_config
    from harness.train.vision_checks import problems

    recipe = load_recipe("zero2", [f"train.model={folder}", f"train.dataset={data}", "train.format=chat", *sets])[0]
    return problems(SimpleNamespace(recipe=recipe, pp=1, tp=1, sp=1), load_model_config(folder))


def model_of(folder: str):
    from transformers import AutoModelForImageTextToText

    from harness.model import vision

    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    vision.install(model)
    return model


def loss_and_grads(model, batch, num_calls: int):
    from harness.data.rows import loss_items

    model.zero_grad(set_to_none=True)
    ids, labels, images, *positions = batch  # position ids under train.packing=document
    loss = model(input_ids=ids, labels=labels, images=images, num_calls=num_calls, per_call=1, use_cache=False,
                 position_ids=positions[0] if positions else None, num_items_in_batch=loss_items(labels)).loss
    loss.backward()
    return loss.detach(), {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()}


@pytest.mark.parametrize("family", ["qwen", "qwen3", "llava", "gemma"])
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


@pytest.mark.parametrize("family", ["qwen", "llava", "gemma"])
def test_store_keeps_image_tokens_with_their_images(folders, family, tmp_path):
    """Each row's image tokens equal the features its images give, no image token is a loss target, and the
    loss covers exactly the assistant turns."""
    from harness.model import vision

    rows, lines = rows_of(folders[family], folders["data"], tmp_path / "store")
    assert "4 conversations (3 with images, 4 images" in lines[0], lines
    model = model_of(folders[family])
    token = vision.image_token_id(model.config)
    for i in range(len(rows)):
        ids, labels, images, _ = rows[i:i + 1].tensors()
        if len(images):
            with torch.no_grad():
                feats = [vision.image_features(model, p, None if not images.grids else g.unsqueeze(0))
                         for p, g in zip(images.pixels, images.grids or [None] * len(images))]
            assert int((ids == token).sum()) == sum(f.shape[0] for f in feats)
        assert not bool(((ids == token) & (labels != -100)).any())
        assert int((labels != -100).sum()) > 0


@pytest.mark.parametrize("family", ["qwen", "qwen3", "llava", "gemma"])
def test_planner_part_counts_equal_the_live_model(folders, family):
    from harness.model_shapes import load_model_config
    from harness.planner.params import count_params
    from harness.planner.vision import image_tokens, meta_parts, parts_count, vision_patches

    cfg = load_model_config(folders[family])
    model = model_of(folders[family])
    live = parts_count(model.named_parameters(), model.config.model_type)
    assert meta_parts(cfg) == live
    assert count_params(cfg).total == sum(live.values()) == sum(p.numel() for p in model.parameters())
    assert live["vision"] > 0 and live["projector"] > 0 and live["language"] > 0
    if family == "qwen3":  # the deepstack mergers are projectors (vision.freeze / vision.lora "projector")
        assert live["projector"] == sum(p.numel() for n, p in model.named_parameters() if "merger" in n)
    if not family.startswith("qwen"):  # a fixed-size tower: the tokens it runs on (CLIP's CLS, SigLIP none), it gives
        from harness.model import vision

        size = model.config.vision_config.image_size
        pixels, _ = vision.placeholder(model.config)
        with torch.no_grad():
            tower = model.model.vision_tower(pixel_values=pixels).last_hidden_state
            feats = vision.image_features(model, pixels, None)
        assert vision_patches(cfg, size, size) == tower.shape[1]
        assert image_tokens(cfg, size, size) == feats.shape[0]


def test_qwen3_vl_forward_equals_transformers_own(folders, tmp_path):
    """Qwen3-VL's deepstack features (per-layer tower features its language model adds at the image tokens after its
    first layers) go through the harness's own forward: against transformers' forward given the same pixel_values
    and image_grid_thw in one call, a one-image row (one real and one placeholder call) gives the same loss and
    gradients bit for bit, a two-image row (two real calls and a placeholder) the same loss and every gradient
    within 1e-6 relative (fp32: two calls sum the tower's gradients in another order); the deepstack mergers train."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLForConditionalGeneration

    from harness.data.rows import loss_items

    rows, _ = rows_of(folders["qwen3"], folders["data"], tmp_path / "store")
    model = model_of(folders["qwen3"])
    for row, calls, tol in ((1, 2, 0.0), (2, 3, 1e-6)):
        ids, labels, images, *_ = rows[row:row + 1].tensors()
        assert len(images) == calls - 1 and int((ids == model.config.image_token_id).sum()) > 0
        ours, our_grads = loss_and_grads(model, (ids, labels, images), num_calls=calls)
        model.zero_grad(set_to_none=True)
        pixels, grid = images.batch(list(range(len(images))))
        ref = Qwen3VLForConditionalGeneration.forward(
            model, input_ids=ids, labels=labels, pixel_values=pixels, image_grid_thw=grid, use_cache=False,
            mm_token_type_ids=(ids == model.config.image_token_id).int(), num_items_in_batch=loss_items(labels)).loss
        ref.backward()
        assert abs(float(ours) - float(ref.detach())) <= tol * float(ref.detach()), (row, float(ours), float(ref))
        for name, param in model.named_parameters():
            assert param.grad is not None and our_grads[name] is not None, name
            rel = float((our_grads[name] - param.grad).norm() / param.grad.norm())
            assert rel <= tol, (row, name, rel)
        assert all(torch.count_nonzero(g) for n, g in our_grads.items() if "deepstack_merger_list" in n)


@pytest.mark.parametrize("family,parts", [("qwen", ["language"]), ("llava", ["language"]),
                                          ("qwen", ["projector"]), ("llava", ["language", "projector"]),
                                          ("qwen3", ["language", "projector"])])
def test_lora_goes_on_the_parts_vision_lora_names(folders, family, parts, tmp_path):
    """adapter.type=lora with vision.lora: adapters on exactly the named parts (the language model's projections,
    every Linear of the projector), never on the tower (a CLIP tower's q_proj / v_proj match the default
    suffixes); the harness's forward trains every adapter B on an image row."""
    from harness.config.recipes import load_recipe
    from harness.model import adapters
    from harness.planner.vision import family_of

    recipe = load_recipe("lora_zero2", [f"vision.lora={json.dumps(parts)}"])[0]
    model = adapters.apply(model_of(folders[family]), recipe)
    part = family_of(model.config.model_type).part_of
    lora = [n for n, _ in model.named_parameters() if ".lora_A." in n]
    assert lora and {part(n) for n in lora} == set(parts), lora
    if "projector" in parts:  # every Linear of the projector: LLaVA linear_1 / linear_2, Qwen-VL's merger mlp.0 /
        # mlp.2, Qwen3-VL's merger and its two deepstack mergers linear_fc1 / linear_fc2
        assert len([n for n in lora if part(n) == "projector"]) == (6 if family == "qwen3" else 2), lora
    assert all(p.requires_grad == adapters.is_trainable_name(n) for n, p in model.named_parameters())
    rows, _ = rows_of(folders[family], folders["data"], tmp_path / "store")
    loss, grads = loss_and_grads(model, rows[1:2].tensors(), num_calls=1)
    assert torch.isfinite(loss) and all(g is not None for n, g in grads.items() if ".lora_B." in n)


def test_plan_counts_the_tower_image_tokens_and_what_freezing_saves(folders, capsys):
    """`harness plan --images-per-sample 2 --image-size 224x224`: the parts' counts equal the live model's, 2 x 64
    image tokens (224 / 28 = 8 merged patches a side), freezing a part saves its gradient + fp32 master + Adam
    states (2 + 4 x 3 = 14 B/param in bf16), per rank / 2 GPUs."""
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


def test_gemma3_rows_and_forward_equal_transformers_own(folders, tmp_path):
    """Gemma 3: its template writes <start_of_image>, which the store expands as Gemma3Processor does (blank lines,
    begin, mm_tokens_per_image image tokens, end): the stored ids and pixels equal the processor's own (it loads
    without torchvision); the harness's forward (token_type_ids from the image tokens: bidirectional attention
    within each image) equals transformers' forward with pixel_values and the processor's token_type_ids, in logits
    and loss; an SGD step on the harness's loss lowers it."""
    from transformers import AutoTokenizer
    from transformers.models.gemma3.processing_gemma3 import Gemma3Processor

    from harness.data.vision import open_image
    from harness.model import vision
    from harness.model.vision import load_image_processor

    folder, root = folders["gemma"], folders["root"]
    rows, _ = rows_of(folder, folders["data"], tmp_path / "store")
    model = model_of(folder)
    record = json.loads(Path(folders["data"]).read_text().splitlines()[1])
    tokenizer = AutoTokenizer.from_pretrained(folder)
    processor = Gemma3Processor(image_processor=load_image_processor(folder, model.config), tokenizer=tokenizer,
                                chat_template=tokenizer.chat_template, image_seq_length=4)
    messages = [{**m, "content": [{**p, "image": open_image(p["image"], root / "data", "t")} if p["type"] == "image"
                                  else p for p in m["content"]] if isinstance(m["content"], list) else m["content"]}
                for m in record["messages"]]
    theirs = processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt")
    ids, labels, images = rows[1:2].tensors()[:3]
    n = theirs["input_ids"].shape[1]
    assert torch.equal(ids[0, :n], theirs["input_ids"][0]) and int((ids[0, n:] != tokenizer.pad_token_id).sum()) == 0
    assert torch.equal(images.pixels[0], theirs["pixel_values"])
    assert int(theirs["token_type_ids"].sum()) == 4 and not bool((labels[0, :n][theirs["token_type_ids"][0] == 1]
                                                                    != -100).any())
    cut = slice(0, n)
    with torch.no_grad():
        ref = type(model).forward(model, input_ids=ids[:, cut], pixel_values=theirs["pixel_values"],
                                  token_type_ids=theirs["token_type_ids"], labels=labels[:, cut])
        ours = model(input_ids=ids[:, cut], labels=labels[:, cut], images=images, num_calls=1)
        causal = type(model).forward(model, input_ids=ids[:, cut], pixel_values=theirs["pixel_values"])
    assert torch.allclose(ours.logits, ref.logits, atol=1e-5, rtol=0), float((ours.logits - ref.logits).abs().max())
    assert abs(float(ours.loss) - float(ref.loss)) <= 1e-6
    assert not torch.allclose(causal.logits, ref.logits, atol=1e-4)  # the image block's mask matters
    loss, _ = loss_and_grads(model, (ids, labels, images), num_calls=2)
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.5 * p.grad if p.grad is not None else 0
        after = model(input_ids=ids, labels=labels, images=images, num_calls=1).loss
    assert float(after) < float(loss), (float(loss), float(after))
    assert vision.family_of(model.config).name == "gemma3"


def test_gemma3_lora_parts_and_what_is_refused(folders, tmp_path):
    """Gemma 3 under LoRA: vision.lora=["projector"] is refused before launch (its projector has no Linear layer),
    the language model's projections take adapters, the projector trains in full as a module to save (what the
    refusal suggests); pan-and-scan is refused with the fix. Valid records pass the checks before launch."""
    import shutil

    from harness.config.recipes import load_recipe
    from harness.errors import UsageError
    from harness.model import adapters
    from harness.model.vision import load_image_processor, lora_targets

    folder = folders["gemma"]
    model = model_of(folder)
    with pytest.raises(UsageError, match="has no Linear layer to adapt"):
        lora_targets(model, ["q_proj"], ["projector"])
    assert all(".language_model." in n for n in lora_targets(model, ["q_proj", "v_proj"], ["language"]))
    assert before_launch(folder, folders["data"], []) == []  # the records' <start_of_image> count as placeholders
    refused = before_launch(folder, folders["data"], ["adapter.type=lora", 'vision.lora=["projector"]'])
    assert [p.path for p in refused] == ["vision.lora"] and "Gemma 3's is one weight matrix" in refused[0].message
    recipe = load_recipe("lora_zero2", ['adapter.modules_to_save=["multi_modal_projector"]'])[0]
    lora = adapters.apply(model, recipe)
    rows, _ = rows_of(folder, folders["data"], tmp_path / "store")
    _, grads = loss_and_grads(lora, rows[1:2].tensors(), num_calls=1)
    saved = [n for n in grads if ".modules_to_save." in n and "mm_input_projection_weight" in n]
    assert saved and all(torch.count_nonzero(grads[n]) for n in saved), sorted(grads)[:5]
    scan = tmp_path / "pan_and_scan"  # Gemma 3's crops
    shutil.copytree(folder, scan)
    config = json.loads((scan / "preprocessor_config.json").read_text())
    (scan / "preprocessor_config.json").write_text(json.dumps({**config, "do_pan_and_scan": True}))
    with pytest.raises(UsageError, match='fix: set "do_pan_and_scan": false in its preprocessor_config.json'):
        load_image_processor(str(scan), model.config)


@pytest.mark.parametrize("family", ["qwen", "llava", "gemma"])
def test_load_by_share_reads_what_from_pretrained_loads(folders, family):
    """ZeRO-3's build by module reads the folder itself (model/load/base.open_model): under the model's names
    (transformers' renamings applied: Qwen2-VL and LLaVA store older layouts), every tensor equal to the one
    from_pretrained loads; the tied head is the only name not read."""
    from harness.model.load.base import open_model
    from harness.model.load.slices import Request

    _, source, _ = open_model(SimpleNamespace(recipe={"train": {"model": folders[family], "seed": 0},
                                                      "precision": "fp32"}))
    live = model_of(folders[family]).state_dict()
    got = source.read({k: Request() for k in source.keys()}, torch.float32)
    assert all(torch.equal(got[k], live[k]) for k in got)
    assert set(live) - set(got) <= {"lm_head.weight"}


def test_hf_dataset_image_column_stores_the_pixels_files_give(folders, tmp_path):
    """A datasets.Dataset whose rows carry their images in an `images` column (Sequence(Image()), PNG bytes
    embedded), saved as parquet: the store holds the same tokens and pixels as the same conversations with the
    images given as files, and an SGD step on its rows lowers the loss; a single `image` column and undecoded
    bytes ({"bytes": ...}, Image(decode=False)) read the same."""
    import datasets
    import numpy as np
    from PIL import Image

    from harness.data.vision import _refs, open_image

    files = write_images(tmp_path / "img", 3)
    kinds, messages, columns, k = ["image", "text", "two", "image"], [], [], 0
    for i, kind in enumerate(kinds):
        count = {"text": 0, "image": 1, "two": 2}[kind]
        parts = [{"type": "image", "text": None}] * count + [{"type": "text", "text": f"record {i}: what?"}]
        messages.append([{"role": "user", "content": parts},
                         {"role": "assistant", "content": [{"type": "text", "text": f"answer {i}"}]}])
        columns.append([files[(k + j) % len(files)] for j in range(count)])
        k += count
    pil = [[Image.fromarray(np.asarray(Image.open(f).convert("RGB"))) for f in paths] for paths in columns]
    table = datasets.Dataset.from_dict({"messages": messages, "images": pil}, features=datasets.Features(
        {"messages": [{"role": datasets.Value("string"), "content": [{"type": datasets.Value("string"),
                                                                       "text": datasets.Value("string")}]}],
         "images": datasets.List(datasets.Image())}))
    parquet = tmp_path / "hf" / "train.parquet"
    table.to_parquet(parquet)
    as_files = [{"messages": [{**m, "content": [{**p, "image": f} if p["type"] == "image" else p for p, f in
                                               zip(m["content"], iter_paths(m, paths))]} for m in record]}
                for record, paths in zip(messages, columns)]
    jsonl = tmp_path / "files.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in as_files))
    rows, lines = rows_of(folders["qwen"], str(parquet), tmp_path / "store")
    want, _ = rows_of(folders["qwen"], str(jsonl), tmp_path / "store")
    assert "4 conversations (3 with images, 4 images" in lines[0], lines
    assert len(rows) == len(want)  # packed alike: compare row by row
    for i in range(len(rows)):
        (ids, labels, images), (ids2, labels2, images2) = rows[i:i + 1].tensors()[:3], want[i:i + 1].tensors()[:3]
        assert torch.equal(ids, ids2) and torch.equal(labels, labels2) and len(images) == len(images2)
        assert all(torch.equal(a, b) for a, b in zip(images.pixels + images.grids, images2.pixels + images2.grids))
    model = model_of(folders["qwen"])
    row = next(i for i in range(len(rows)) if len(rows[i:i + 1].tensors()[2]) >= 2)  # the two-image record's row
    batch = rows[row:row + 1].tensors()[:3]
    calls = len(batch[2])
    loss, _ = loss_and_grads(model, batch, num_calls=calls)
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.5 * p.grad if p.grad is not None else 0
        assert float(model(input_ids=batch[0], labels=batch[1], images=batch[2], num_calls=calls).loss) < float(loss)
    raw = datasets.Dataset.from_parquet(str(parquet)).cast_column("images", datasets.List(
        datasets.Image(decode=False)))[0]
    assert raw["images"][0]["bytes"] and not raw["images"][0]["path"]  # the file holds the images, not paths
    single = {"messages": messages[0], "image": raw["images"][0]}
    assert np.array_equal(np.asarray(open_image(_refs(single, messages[0], "t")[0], tmp_path, "t")),
                          np.asarray(open_image(files[0], tmp_path, "t")))


def iter_paths(message: dict, paths: list[str]):
    """Each content part's image path (the record's next one for an image part, None for text)."""
    taken = iter(paths)
    return [next(taken) if p["type"] == "image" else None for p in message["content"]]


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
