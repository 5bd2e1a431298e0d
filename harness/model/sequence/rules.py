"""Refusals of the long-context keys, before any rank trains (harness.train.checks.before_init): each names the
values, the arithmetic and the fix. Pure functions of the recipe, the model's config dict and this machine."""

from __future__ import annotations

from harness.errors import Problem
from harness.model_shapes import ulysses_splits_heads, ulysses_splits_kv_heads

FULL = ("full_attention",)


def _heads(cfg: dict) -> tuple[int | None, int | None]:
    text = cfg.get("text_config") or cfg
    heads = text.get("num_attention_heads", text.get("n_head"))
    return heads, text.get("num_key_value_heads") or heads


def _windowed(cfg: dict) -> str | None:
    """What in the config makes some layers attend to a window or linearly, else None."""
    text = cfg.get("text_config") or cfg
    kinds = sorted({k for k in text.get("layer_types") or () if k not in FULL})
    if kinds:
        return f"layer_types has {', '.join(kinds)} layers"
    if text.get("layer_types") is None and text.get("sliding_window") and text.get("use_sliding_window", True):
        return f"sliding_window {text['sliding_window']} is on"
    return None


def degree_problems(sp: int, world: int, pp: int, tp: int, seq_len: int, cfg: dict) -> list[Problem]:
    if sp == 1:
        return []
    out, key = [], "parallel.sequence"
    if world % sp:
        out.append(Problem(key, f"sequence-parallel degree {sp} does not divide the world size {world} "
                           f"({world} % {sp} = {world % sp}): ranks = sp x data parallel",
                           f"launch a multiple of {sp} ranks, or --set parallel.sequence=S with S dividing {world}"))
    if pp > 1 or tp > 1:
        out.append(Problem(key, f"sequence parallelism ({sp}) with pipeline {pp} / tensor {tp} is not supported "
                           "(the Ulysses wrapper and the harness's loss reduction are tested on data-parallel "
                           "layouts only)", "--set parallel.pipeline=1 parallel.tensor=1, or parallel.sequence=1"))
    if seq_len % sp:
        out.append(Problem("train.seq_len", f"seq_len {seq_len} does not split over sequence-parallel degree {sp} "
                           f"({seq_len} % {sp} = {seq_len % sp}): each rank holds seq_len / sp tokens of a row",
                           f"--set train.seq_len={seq_len - seq_len % sp} (or {seq_len + sp - seq_len % sp})"))
    heads, kv = _heads(cfg)
    if isinstance(heads, int) and not ulysses_splits_heads(heads, sp):
        out.append(Problem(key, f"{heads} attention heads do not split over sequence-parallel degree {sp} "
                           f"({heads} % {sp} = {heads % sp}): after the all-to-all each rank holds heads / sp",
                           f"--set parallel.sequence=S with S dividing {heads}"))
    if isinstance(kv, int) and not ulysses_splits_kv_heads(kv, sp):
        out.append(Problem(key, f"{kv} kv heads and sequence-parallel degree {sp}: neither divides the other "
                           f"({kv} % {sp} = {kv % sp}, {sp} % {kv} = {sp % kv}); Ulysses splits kv heads over sp ranks "
                           "or replicates them sp / kv times", f"--set parallel.sequence=S with S dividing {kv} "
                           f"or a multiple of it"))
    if (why := _windowed(cfg)) is not None:
        out.append(Problem(key, f"the model's {why}: under sequence parallelism DeepSpeed's wrapper rebuilds a plain "
                           "causal mask after the all-to-all, so the window would be silently dropped",
                           "parallel.sequence=1 for this model, or a model with full attention in every layer"))
    return out


def attention_problems(train: dict, sp: int, cuda: bool) -> list[Problem]:
    """What Ulysses does to an attention choice (and activation offload on CPU)."""
    name, out = train["attention"], []
    if name == "eager" and sp > 1:
        out.append(Problem("train.attention", f"eager attention under sequence parallelism ({sp}): it needs a 4D "
                           f"float mask of seq_len^2 = {train['seq_len']}^2 entries per row and head, which the "
                           "Ulysses wrapper discards", "--set train.attention=auto (document_sdpa on CPU, "
                           "flash_attention_2 on a GPU with flash-attn)"))
    if name in ("sdpa", "flex_attention") and sp > 1 and train["packing"] == "document":
        out.append(Problem("train.attention", f"{name} under sequence parallelism ({sp}) loses the document mask: "
                           "DeepSpeed's Ulysses wrapper discards the mask transformers built for the local shard "
                           "(flex: rebuilds a plain causal one), so packed documents would attend to each other",
                           "--set train.attention=auto (flash_attention_2 on a GPU with flash-attn, else the "
                           "harness's document_sdpa)"))
    # flash-attention on CPU / not installed: harness.model.attention.problems (one place for every layout)
    if train["activation_offload"] and not cuda:
        out.append(Problem("train.activation_offload", "activation offload moves saved activations from GPU to "
                           "host memory; on the CPU accelerator they are in host memory already (DeepSpeed's "
                           "checkpoint offload does nothing there), so it would be a silent no-op",
                           "--set train.activation_offload=false on CPU"))
    return out


def problems(recipe: dict, cfg: dict, sp: int, world: int, pp: int, tp: int, cuda: bool) -> list[Problem]:
    train = recipe["train"]
    out = degree_problems(sp, world, pp, tp, train["seq_len"], cfg) + attention_problems(train, sp, cuda)
    if train["activation_offload"] and cuda and not recipe["activation_checkpointing"]:
        out.append(Problem("train.activation_offload", "activation offload moves the checkpointed hidden states "
                           "to host memory, but activation_checkpointing is off (every activation would be "
                           "copied over PCIe)", "--set activation_checkpointing=true"))
    return out
