"""Tiny vision-language folders written with save_pretrained (seeded random weights, transformers' own config
classes): a Qwen2-VL, a Qwen2.5-VL, a Qwen3-VL (with deepstack layers), a LLaVA (CLIP vision tower + projector +
Llama) and a Gemma 3 (SigLIP + Gemma 3), each with the shipped tokenizer plus the family's image tokens, a chat
template that renders image parts as the family does, and the family's image processor saved beside them (the PIL
ones: no torchvision needed)."""

from __future__ import annotations

import torch

QWEN_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
LLAVA_TOKENS = ["<image>"]
VOCAB = 520  # the shipped tokenizer's 512 + the added image tokens, rounded up

_TURN = ("{% for m in messages %}<|{{ m['role'] }}|>\n{% if m['content'] is string %}{{ m['content'] }}{% else %}"
         "{% for p in m['content'] %}{% if p['type'] == 'image' %}IMAGE{% elif p['type'] == 'video' %}VIDEO{% else %}"
         "{{ p['text'] }}{% endif %}"
         "{% endfor %}{% endif %}<|endoftext|>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
QWEN_TEMPLATE = _TURN.replace("IMAGE", "<|vision_start|><|image_pad|><|vision_end|>").replace(
    "VIDEO", "<|vision_start|><|video_pad|><|vision_end|>")
LLAVA_TEMPLATE = _TURN.replace("IMAGE", "<image>\n").replace("VIDEO", "")


def _tokenizer(tokens: list[str], template: str):
    from harness.model.hf import load_tokenizer

    tok = load_tokenizer("tiny-llama")
    tok.add_special_tokens({"additional_special_tokens": tokens})
    tok.chat_template = template
    return tok


def _qwen_family_folder(path, seed: int, family: str, text: dict, vision: dict, patch: int) -> str:
    """A tiny Qwen-VL folder of transformers' `{family}Config` / `{family}ForConditionalGeneration`: the shipped
    tokenizer + the Qwen image/video tokens and template, a 2-head language model of hidden 64 (with `text`'s
    overrides) and `vision`, seeded random weights, Qwen2-VL's PIL image processor at `patch` (merge 2)."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = _tokenizer(QWEN_TOKENS, QWEN_TEMPLATE)
    ids = tok.convert_tokens_to_ids(QWEN_TOKENS)
    eos = tok.eos_token_id
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, rope_parameters={"rope_type": "default",
                "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}, bos_token_id=eos, eos_token_id=eos,
                attention_dropout=0.0) | text
    config = getattr(transformers, f"{family}Config")(
        text_config=text, vision_config=vision, vision_start_token_id=ids[0], vision_end_token_id=ids[1],
        image_token_id=ids[2], video_token_id=ids[3], tie_word_embeddings=False)
    torch.manual_seed(seed)
    getattr(transformers, f"{family}ForConditionalGeneration")(config).save_pretrained(path)
    tok.save_pretrained(path)
    Qwen2VLImageProcessorPil(min_pixels=4 * (2 * patch) ** 2, max_pixels=16 * (2 * patch) ** 2, patch_size=patch,
                             merge_size=2, temporal_patch_size=2).save_pretrained(path)
    return str(path)


def qwen2_vl_folder(path, seed: int = 1234) -> str:
    """A tiny Qwen2-VL: 2-layer vision tower (patch 14, merge 2) + merger + 2-layer Qwen2 language model."""
    vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    return _qwen_family_folder(path, seed, "Qwen2VL", {}, vision, patch=14)


def qwen2_5_vl_folder(path, seed: int = 1234) -> str:
    """A tiny Qwen2.5-VL: 2-layer windowed vision tower (patch 14, merge 2, window 56, block 1 full attention) +
    merger + 2-layer language model; 2 tokens per second of video in its time positions."""
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1],
                  tokens_per_second=2, in_channels=3)
    return _qwen_family_folder(path, seed, "Qwen2_5_VL", {}, vision, patch=14)


def qwen3_vl_folder(path, seed: int = 1234) -> str:
    """A tiny Qwen3-VL: 3-layer vision tower (patch 16, merge 2, learned positions resampled per grid) + merger + two
    deepstack mergers (tower layers 0 and 1, added into the first two language layers' hidden states at the image
    tokens; after the last layer they would reach no label) + 3-layer Qwen3 language model; Qwen2-VL's PIL image
    processor at patch 16, as Qwen3-VL ships it (AutoImageProcessor picks it without torchvision)."""
    text = dict(num_hidden_layers=3, head_dim=16, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3], "mrope_interleaved": True})
    vision = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                  deepstack_visual_indexes=[0, 1], in_channels=3)
    return _qwen_family_folder(path, seed, "Qwen3VL", text, vision, patch=16)


def write_frames(folder, count: int, size=(42, 56), seed: int = 11) -> list[str]:
    """`count` RGB PNG frames of one size (seeded noise): a video as a folder / list of frames."""
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(count):
        path = folder / f"frame{i:03d}.png"
        Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8)).save(path)
        paths.append(str(path))
    return paths


def write_mp4(path, count: int, fps: int = 4, size=(42, 56)) -> str:
    """A small MPEG-4 file written with PyAV: frame i a flat grey of level 30 * i."""
    import av
    import numpy as np

    with av.open(str(path), "w") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.height, stream.width, stream.pix_fmt = size[0], size[1], "yuv420p"
        for i in range(count):
            frame = av.VideoFrame.from_ndarray(np.full((*size, 3), 30 * i % 256, np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return str(path)


def llava_folder(path, seed: int = 1234) -> str:
    """A tiny LLaVA: 2-layer CLIP vision tower (image 28, patch 14: 4 patches + CLS) + MLP projector + Llama."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    tok = _tokenizer(LLAVA_TOKENS, LLAVA_TEMPLATE)
    eos = tok.eos_token_id
    text = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       bos_token_id=eos, eos_token_id=eos, attention_dropout=0.0)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=28, patch_size=14, projection_dim=32)
    config = LlavaConfig(text_config=text, vision_config=vision, image_token_id=tok.convert_tokens_to_ids("<image>"),
                         vision_feature_layer=-1, vision_feature_select_strategy="default",
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    LlavaForConditionalGeneration(config).save_pretrained(path)
    tok.save_pretrained(path)
    LlavaImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}).save_pretrained(path)
    return str(path)


GEMMA_TOKENS = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]


def gemma3_folder(path, seed: int = 1234) -> str:
    """A tiny Gemma 3: 2-layer SigLIP tower (image 56, patch 14: 16 patches, pooled to 4 image tokens) + Gemma 3's
    projector + 2-layer Gemma 3 text model (one sliding, one full attention layer); Gemma 3's own chat template
    (tests/fixtures/chat_templates), its image tokens as its tokenizer names them (boi / eoi / image token), and
    its PIL image processor (no torchvision)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    from helpers.chat_templates import template_tokenizer

    tok = template_tokenizer("gemma3")
    tok.add_special_tokens({"additional_special_tokens": GEMMA_TOKENS})
    tok._set_model_specific_special_tokens(dict(zip(("boi_token", "eoi_token", "image_token"), GEMMA_TOKENS)))
    boi, eoi, image = tok.convert_tokens_to_ids(GEMMA_TOKENS)
    text = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                            sliding_window=32, layer_types=["sliding_attention", "full_attention"],
                            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                            pad_token_id=tok.pad_token_id, attention_dropout=0.0)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                image_size=56, patch_size=14)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, boi_token_index=boi,
                          eoi_token_index=eoi, image_token_index=image, tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config)
    with torch.no_grad():  # transformers initialises the projector's matrix to zeros: give the images a say
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.05)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    Gemma3ImageProcessorPil(size={"height": 56, "width": 56}).save_pretrained(path)
    return str(path)


def write_images(folder, count: int, seed: int = 7) -> list[str]:
    """`count` small RGB PNGs of varied sizes (seeded noise)."""
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(count):
        h, w = (28, 28) if i % 3 == 0 else (40 + 6 * (i % 4), 56 + 4 * (i % 5))
        path = folder / f"img{i}.png"
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(path)
        paths.append(str(path))
    return paths


def write_chat(path, images: list[str], kinds: list[str], seed: int = 3, frames: list[str] | None = None) -> str:
    """A JSONL of chat records: kinds[i] 'text' (content strings), 'image' (one image part + text), 'two' (two
    images), 'video' (a video part listing `frames`, then an image part); paths relative to the file's folder where
    they lie under it."""
    import json
    import random
    from pathlib import Path

    rng, lines, k = random.Random(seed), [], 0
    words = "the a cat dog red blue sky tree house runs sits big small".split()
    for i, kind in enumerate(kinds):
        say = " ".join(rng.choice(words) for _ in range(rng.randint(3, 7)))
        answer = " ".join(rng.choice(words) for _ in range(rng.randint(2, 6)))
        if kind == "text":
            user = {"role": "user", "content": f"record {i}: {say}"}
        else:
            rel = [str(Path(f).relative_to(Path(path).parent)) for f in frames or ()]
            parts = [{"type": "video", "video": rel}] if kind == "video" else []
            for _ in range(2 if kind == "two" else 1):
                ref = Path(images[k % len(images)])
                k += 1
                parts.append({"type": "image", "image": str(ref.relative_to(Path(path).parent))
                              if ref.is_relative_to(Path(path).parent) else str(ref)})
            user = {"role": "user", "content": [*parts, {"type": "text", "text": f"record {i}: {say}"}]}
        lines.append(json.dumps({"messages": [user, {"role": "assistant", "content": answer}]}))
    Path(path).write_text("\n".join(lines) + "\n")
    return str(path)
