"""Which attention implementation a run uses, and what its document mask costs, decided before any rank starts.

Under train.packing=document the model gets position ids that restart per document and no attention_mask;
transformers (5.x, masking_utils / modeling_flash_attention_utils) then keeps each document's attention inside it:
    flash_attention_2/3  varlen kernels over the documents (cu_seqlens from the position ids): no mask at all, but
                         ONLY at batch size 1 (_is_packed_sequence); at micro-batch > 1 the documents are silently
                         ignored (flash's mask is None without padding), so that combination is refused.
    flex_attention       a BlockMask: bytes ~ (S / 128)^2 per row, no S^2 tensor. No backward on CPU (torch 2.13:
                         "FlexAttention does not support backward on CPU"), so CPU training cannot use it.
    sdpa                 a materialised boolean mask [micro, 1, S, S]: micro * S^2 bytes.
    eager                a materialised float mask [micro, 1, S, S] in the compute dtype: micro * S^2 * itemsize.
Gemma 3 (image tokens attend to each other both ways; harness/model/vision_masks.py builds its packed masks) needs
a mask function flash's varlen kernels cannot take: under document packing it never gets flash-attention, and it
materialises two masks (full and sliding layers) where a text model has one.
`choose` is the one decision (device, installed kernels, packing, seq_len, micro-batch); `problems` turns a choice
into refusals (exit 2 before ranks start) and a warning naming the bytes of a materialised mask. sp-core's
sequence parallel attention reuses both (under Ulysses only flash varlen or the harness's own attention keep it).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from harness.config.defaults import PRECISION_BYTES
from harness.config.preference_rules import packing
from harness.errors import Problem

MASK_BOUND_BYTES = 1 << 30  # a materialised document mask larger than this (per forward, per rank) is refused
FLEX_BLOCK = 128  # flex_attention's default block size (BlockMask granularity)
IMPLEMENTATIONS = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")


@dataclass(frozen=True)
class AttentionChoice:
    implementation: str  # the transformers attn_implementation
    mask_bytes: int  # the mask tensor one forward materialises on a rank (all layers share it)
    materialised: bool  # an S^2 mask (sdpa / eager under document packing)
    why: str
    masks: int = 1  # masks one forward builds: 2 for Gemma 3 under document packing (full and sliding layers)


def installed_kernels() -> frozenset[str]:
    """The attention kernel packages importable here (flash_attn: FA2; flash_attn_interface: FA3)."""
    names = {"flash_attn": "flash_attention_2", "flash_attn_interface": "flash_attention_3"}
    return frozenset(impl for module, impl in names.items() if importlib.util.find_spec(module) is not None)


def mask_bytes(implementation: str, packing: str, seq_len: int, micro_batch: int, itemsize: int = 4) -> int:
    """Bytes of the attention mask a forward builds for one micro-batch under this packing."""
    if packing != "document" or implementation.startswith("flash_attention"):
        return 0  # concat: is_causal (sdpa) / causal kernels, no mask; flash varlen: cu_seqlens only
    if implementation == "flex_attention":
        blocks = -(-seq_len // FLEX_BLOCK)
        return micro_batch * blocks * blocks * 4 * 2  # kv block counts/indices, full and partial (int32)
    per = 1 if implementation == "sdpa" else itemsize
    return micro_batch * seq_len * seq_len * per


def has_image_blocks(config) -> bool:
    """A family whose image tokens attend to each other both ways (Gemma 3's token_type_ids); config: an HF config
    object or its dict."""
    from harness.planner.vision import family_of

    model_type = config.get("model_type", "") if isinstance(config, dict) else getattr(config, "model_type", "")
    return config is not None and family_of(model_type or "").token_types


def choose(device: str, packing: str, seq_len: int, micro_batch: int = 1, installed: frozenset[str] | None = None,
           requested: str | None = None, itemsize: int = 4, image_blocks: bool = False) -> AttentionChoice:
    """The attention implementation for a run. requested None: on CUDA, flash-attention (3, else 2) where installed
    and it keeps the documents (concat, or micro-batch 1), else flex_attention under document packing (no S^2
    mask), else sdpa; on CPU sdpa (flex cannot train there, flash needs CUDA), whose document mask is materialised.
    A requested implementation is taken as given (`problems` says when it cannot work). image_blocks (Gemma 3): no
    flash-attention under document packing (module docstring)."""
    installed = installed_kernels() if installed is None else installed
    blocked = image_blocks and packing == "document"
    if requested is None:
        flash = None if blocked else next((f for f in ("flash_attention_3", "flash_attention_2") if f in installed),
                                          None)
        if device == "cuda" and flash and (packing != "document" or micro_batch == 1):
            implementation, why = flash, f"{flash} is installed" + (" (varlen over the documents)"
                                                                    if packing == "document" else "")
        elif device == "cuda" and packing == "document":
            implementation, why = "flex_attention", "document masking without an S^2 mask (" + (
                "Gemma 3's image blocks need a mask function)" if blocked else "flash-attention is not installed)"
                if not flash else f"{flash} keeps documents only at micro-batch 1)")
        else:
            implementation, why = "sdpa", ("CPU: sdpa (flex_attention has no backward on CPU)" if device != "cuda"
                                           else "causal attention without a mask")
    else:
        implementation, why = requested, "requested"
    size = mask_bytes(implementation, packing, seq_len, micro_batch, itemsize)
    materialised = packing == "document" and implementation in ("sdpa", "eager")
    masks = 2 if blocked else 1
    return AttentionChoice(implementation, size * masks, materialised, why, masks)


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.3f} GiB"


def problems(choice: AttentionChoice, device: str, packing: str, seq_len: int, micro_batch: int,
             installed: frozenset[str] | None = None, bound: int = MASK_BOUND_BYTES,
             path: str = "train.packing", image_blocks: bool = False) -> list[Problem]:
    """Refusals for a choice that would drop the document mask, cannot train here, or materialise a mask past
    `bound`; a warning naming the bytes of a materialised mask under the bound."""
    installed = installed_kernels() if installed is None else installed
    impl, out = choice.implementation, []
    if impl.startswith("flash_attention"):
        if device != "cuda":
            out.append(Problem(path, f"{impl} needs a CUDA GPU; this rank runs on {device}",
                               "use sdpa (the CPU default) or run on a GPU"))
        elif impl not in installed:
            out.append(Problem(path, f"{impl} is asked for but its package is not installed",
                               "pip install flash-attn (flash_attention_2) or leave the attention to the default"))
        if packing == "document" and image_blocks:
            out.append(Problem(path, f"{impl} with Gemma 3 under document packing: flash's varlen kernels are causal "
                               "only, so each image's tokens would lose their two-way attention (Gemma 3 needs a mask "
                               "function: same conversation AND (causal OR same image block) AND window)",
                               "train.attention=auto (flex_attention on a GPU, sdpa on CPU), or train.packing=concat"))
        if packing == "document" and micro_batch > 1:
            out.append(Problem(path, f"{impl} keeps packed documents apart only at micro-batch 1 (transformers "
                               f"detects them from position_ids only then); at micro-batch {micro_batch} every "
                               "document would attend to the ones before it in its row",
                               "--set batch.micro_batch_per_gpu=1 (raise batch.grad_accum_steps to keep the global "
                               "batch), or flex_attention, or train.packing=concat"))
    if impl == "flex_attention" and device != "cuda":
        out.append(Problem(path, "flex_attention has no backward on CPU (torch: \"FlexAttention does not support "
                           "backward on CPU\")", "use sdpa on CPU (the default), or train on a GPU"))
    if choice.materialised:
        per = "1 byte" if impl == "sdpa" else "the compute dtype's bytes"
        times = f" x {choice.masks} masks (Gemma 3's full and sliding layers)" if choice.masks > 1 else ""
        arithmetic = (f"{impl} under document packing materialises a [{micro_batch}, 1, {seq_len}, {seq_len}] mask "
                      f"({micro_batch} x {seq_len}^2 x {per}{times} = {choice.mask_bytes} bytes, "
                      f"{_gib(choice.mask_bytes)})")
        if choice.mask_bytes > bound:
            out.append(Problem(path, f"{arithmetic}, past the {_gib(bound)} bound",
                               "on a GPU use flash-attention (pip install flash-attn; micro-batch 1) or flex_attention"
                               ", which need no S^2 mask; or lower train.seq_len / batch.micro_batch_per_gpu until "
                               f"micro x seq_len^2 <= {bound}; or train.packing=concat (documents then attend to "
                               "each other)"))
        elif device == "cuda":
            out.append(Problem(path, f"{arithmetic}: the last resort on a GPU", "pip install flash-attn, or use a "
                               "torch with flex_attention", severity="warning"))
    return out


def device_type() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def requested(recipe: dict, device: str) -> str | None:
    """train.attention as the run asks for it: None for `auto` at sp=1 (`choose` decides); under Ulysses (parallel.
    sequence > 1) `auto` is sequence.attention.resolve's (flash varlen on a GPU with it, else document_sdpa)."""
    from harness.model.sequence.attention import resolve

    name = recipe["train"]["attention"]
    sp = recipe["parallel"]["sequence"]
    if name == "auto" and sp <= 1:
        return None
    return resolve(name, sp, device == "cuda")


def for_recipe(recipe: dict, micro_batch: int, device: str | None = None, image_blocks: bool = False
               ) -> AttentionChoice:
    """The choice for a run's recipe on this machine (what `build` applies and `checks` refuses); image_blocks: the
    model is Gemma 3 (has_image_blocks)."""
    train, device = recipe["train"], device or device_type()
    itemsize = PRECISION_BYTES[recipe["precision"]]
    choice = choose(device, packing(recipe), train["seq_len"], micro_batch, itemsize=itemsize,
                    requested=requested(recipe, device), image_blocks=image_blocks)
    if choice.implementation == "document_sdpa":  # the harness's: [micro, 1, S, S] bool over the FULL sequence
        size = micro_batch * train["seq_len"] ** 2
        return AttentionChoice("document_sdpa", size, True, "the harness's document mask (sequence parallel)")
    return choice


def recipe_problems(recipe: dict, micro_batch: int, device: str | None = None, image_blocks: bool = False
                    ) -> list[Problem]:
    device = device or device_type()
    choice = for_recipe(recipe, micro_batch, device, image_blocks)
    path = "train.attention" if recipe["train"]["attention"] != "auto" else "train.packing"
    return problems(choice, device, packing(recipe), recipe["train"]["seq_len"], micro_batch,
                    path=path, image_blocks=image_blocks)


def apply(model, spec) -> str:
    """Set the chosen implementation on an HF model (or a peft wrapper of one) when it differs from the one it was
    built with (harness.model.hf.ATTN_IMPLEMENTATION, sdpa: the CPU choice, so CPU runs are unchanged)."""
    config = getattr(model, "config", None)
    chosen = for_recipe(spec.recipe, spec.run.batch.micro_batch, image_blocks=has_image_blocks(config)).implementation
    if config is not None:  # gpt-oss builds with eager only (harness/config/moe_families.py)
        from harness.config.moe_families import attn_implementation

        chosen = attn_implementation(config, chosen)
    if config is not None and getattr(config, "_attn_implementation", chosen) != chosen:
        from harness.model.sequence import attention as harness_attention

        harness_attention.apply(model, chosen)  # registers document_sdpa first when it is the one chosen
    return chosen
