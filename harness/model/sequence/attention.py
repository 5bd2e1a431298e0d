"""The attention implementation a run uses (train.attention) and the harness's document-masked one.

`document_sdpa` is registered through transformers' AttentionInterface (and deliberately NOT in its mask
interface, so transformers builds no (S/sp)^2 mask that the Ulysses wrapper would discard). It builds the
block-causal mask from the position ids: a document starts where the position id is 0. Under Ulysses it runs
inside DeepSpeed's wrapper, after the all-to-all, where every rank holds the FULL sequence (heads / sp) and the
wrapper has all-gathered the position ids, so the mask covers whole documents. At sp=1 it is the same mask on
the local sequence. The mask is S x S booleans per micro-batch row (built once per forward and reused by every
layer); flash-attention varlen (GPU) keeps documents apart without it.
"""

from __future__ import annotations

import importlib.util

DOCUMENT = "document_sdpa"
FLASH = ("flash_attention_2", "flash_attention_3")
CHOICES = ("auto", "sdpa", "eager", "flex_attention", *FLASH, DOCUMENT)

_cache: list = []  # [(position ids, mask)]: one mask per forward, reused by every layer (compared by value)


def flash_installed(name: str) -> bool:
    return importlib.util.find_spec("flash_attn_interface" if name == "flash_attention_3" else "flash_attn") is not None


def resolve(name: str, sp: int, cuda: bool) -> str:
    """The implementation `auto` means: flash-attention varlen on a GPU with it installed (documents kept apart
    without an S^2 mask), else the harness's document mask under SP (sdpa there loses the mask), else sdpa."""
    if name != "auto":
        return name
    if cuda and flash_installed("flash_attention_2"):
        return "flash_attention_2"
    return DOCUMENT if sp > 1 else "sdpa"


def document_mask(position_ids):
    """[b, 1, S, S] bool: query i sees key j when j <= i and both lie in the same document (ids restart at 0)."""
    import torch

    if _cache and _cache[0][0].shape == position_ids.shape and torch.equal(_cache[0][0], position_ids):
        return _cache[0][1]
    doc = torch.cumsum((position_ids == 0).to(torch.int32), dim=-1)  # [b, S] document index per token
    seq = position_ids.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=position_ids.device).tril()
    mask = (doc[:, :, None] == doc[:, None, :]) & causal
    _cache[:] = [(position_ids.clone(), mask[:, None])]
    return mask[:, None]


def document_sdpa(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention signature: q/k/v [b, heads, S, d] -> ([b, S, heads, d], None)."""
    import torch

    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        raise RuntimeError("document_sdpa needs position_ids in the attention call (transformers passes them; "
                           "the harness always gives them)")
    if position_ids.dim() == 1:
        position_ids = position_ids[None]
    mask = document_mask(position_ids.to(query.device))
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # grouped-query attention: repeat the kv heads as transformers' sdpa path does
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    if mask.shape[0] != query.shape[0]:
        mask = mask.expand(query.shape[0], -1, -1, -1)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout if module.training else 0.0, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Make `document_sdpa` a name transformers accepts (idempotent; process-wide, like transformers' table)."""
    from transformers import AttentionInterface

    AttentionInterface.register(DOCUMENT, document_sdpa)


def apply(model, name: str) -> None:
    """Switch a built model to the attention implementation `name` (registered first when it is the harness's)."""
    if name == DOCUMENT:
        register()
    setter = getattr(model, "set_attn_implementation", None)
    if setter is not None and name != getattr(model.config, "_attn_implementation", None):
        try:
            setter(name)
            return
        except (ValueError, ImportError, AttributeError):
            pass
    model.config._attn_implementation = name
    for sub in (getattr(model.config, "text_config", None),):
        if sub is not None:
            sub._attn_implementation = name
