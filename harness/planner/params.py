"""Parameter counts from a model's shape, without weights.

Two ways, one answer: a closed form for the families the harness knows (llama, mistral, qwen2, gpt2),
fast enough for `harness plan` to answer in well under a second, and the exact count of what
transformers builds from the same config on the meta device (any architecture; imports torch and
transformers, ~2 s for a 70B). Tests hold the two equal on every built-in shape.

Besides the total, the planner needs: per-block and embedding sizes (tensor and pipeline splits), the
largest module (ZeRO-3 gathers one module's parameters at a time: DeepSpeed's `4 * largest_layer`
term), and a histogram of tensor sizes (ZeRO-3 keeps tensors below `param_persistence_threshold`
whole on every rank).
"""

from __future__ import annotations

import contextlib
import math

from dataclasses import dataclass, field

from harness.model_shapes import LLAMA_LIKE
from harness.planner.shape import ModelShape

CLOSED_FORM_FAMILIES = LLAMA_LIKE + ("gpt2",)


@dataclass(frozen=True)
class ParamCount:
    total: int  # unique parameters (tied weights once)
    num_layers: int
    per_layer: int  # one transformer block
    embedding: int  # token (+ learned position) embeddings
    lm_head: int  # output projection; 0 when tied to the token embedding
    other: int  # final norm and anything else outside the blocks
    largest_layer: int  # largest module's own parameters (DeepSpeed's largest_layer_params)
    largest_tensor: int  # largest single parameter tensor
    tensor_sizes: dict[int, int] = field(default_factory=dict)  # numel -> number of tensors
    method: str = "closed-form"  # or "meta-device"
    # of per_layer, what tensor parallelism splits (column-parallel weights and biases, row-parallel
    # weights); the rest (norms, row-parallel biases) stays whole on every tensor-parallel rank
    per_layer_split: int = 0
    positions: int = 0  # learned position embeddings (GPT-2's wpe), part of `embedding`
    # LoRA (with_lora): the adapters' parameters per block, part of per_layer, the only trainable ones; of
    # them, what tensor parallelism splits (column-parallel B, row-parallel A); the largest adapter tensor
    lora_per_layer: int = 0
    lora_per_layer_split: int = 0
    lora_largest_tensor: int = 0
    # one block's weight tensors in the order the forward uses them, (numel, split by tensor parallelism?):
    # the order backward hooks see them in reverse, which is how ZeRO fills its reduce buckets (known families)
    block_tensors: tuple[tuple[int, bool], ...] = ()
    # Mixture of Experts (moe/counts.py; 0 for dense models): routed experts per sparse block and how many a
    # token goes to, the parameters one token goes through, the routed experts' share of `total` (what AutoEP
    # spreads over the expert-parallel ranks), one sparse block (ZeRO-3 gathers a leaf module whole), its count
    num_experts: int = 0
    top_k: int = 0
    active: int = 0
    routed_experts: int = 0
    moe_block: int = 0
    moe_layers: int = 0
    active_blocks: int = 0  # of `active`, in the blocks
    # parameters DeepSpeed's Muon steps (muon_takes): tensors of 2+ dimensions named without embed / lm_head;
    # None where the count cannot tell (MoE closed form: count_params(exact=True) names them)
    muon_params: int | None = None
    muon_shapes: tuple[tuple[tuple[int, ...], int], ...] = ()  # (shape, how many) of those tensors (ZeRO's layout)

    def trainable_params(self, blocks: int, tp: int = 1) -> int | None:
        """Trainable parameters on a rank holding `blocks` blocks: None for full fine-tuning (all of them)."""
        if not self.lora_per_layer:
            return None
        return blocks * (self.lora_per_layer - self.lora_per_layer_split + self.lora_per_layer_split // tp)

    def lora_state_args(self, blocks: int, tp: int = 1) -> dict:
        """memory.Holding fields for a rank holding `blocks` blocks of a count with LoRA adapters (with_lora);
        none for full fine-tuning."""
        trainable = self.trainable_params(blocks, tp)
        if trainable is None:
            return {}
        return {"trainable": trainable, "largest_trainable_tensor": self.lora_largest_tensor,
                "largest_trainable_layer": self.lora_largest_tensor}

    @property
    def active_params(self) -> int:
        """Parameters one token goes through: all of them in a dense model."""
        return self.active or self.total

    def block_active(self, tp: int = 1) -> float:
        """One block's parameters a token goes through, on one tensor-parallel rank (MoE: the mean over the
        blocks, sparse and dense ones)."""
        if not self.num_experts:
            return self.block_params(tp)
        return self.active_blocks / self.num_layers

    def block_params(self, tp: int = 1) -> int:
        """One block's parameters on one tensor-parallel rank."""
        return self.per_layer - self.per_layer_split + self.per_layer_split // tp

    def persistent_numel(self, threshold: int) -> int:
        """Elements in tensors ZeRO-3 keeps whole on every rank (numel <= threshold)."""
        return sum(n * c for n, c in self.tensor_sizes.items() if n <= threshold)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in (
            "total", "num_layers", "per_layer", "embedding", "lm_head", "other",
            "largest_layer", "largest_tensor", "method", "per_layer_split", "positions", "lora_per_layer",
            "muon_params")} | (
            {k: getattr(self, k) for k in ("num_experts", "top_k", "active", "routed_experts", "moe_block",
                                           "moe_layers")} if self.num_experts else {})


def _sizes(*groups: tuple[int, int]) -> dict[int, int]:
    hist: dict[int, int] = {}
    for numel, count in groups:
        if numel and count:
            hist[numel] = hist.get(numel, 0) + count
    return hist


def _llama_block(cfg: dict) -> tuple[list[tuple[int, int]], list[int]]:
    """(tensor sizes of one block, own-parameter totals of its modules)."""
    h = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    hd = cfg.get("head_dim") or h // heads
    inter = cfg["intermediate_size"]
    qkv_bias = cfg.get("attention_bias", False) or cfg["model_type"] == "qwen2"
    o_bias = cfg.get("attention_bias", False) and cfg["model_type"] != "qwen2"
    mlp_bias = cfg.get("mlp_bias", False)
    q, k = h * heads * hd, h * kv * hd
    modules = [
        q + (heads * hd if qkv_bias else 0),  # q_proj
        k + (kv * hd if qkv_bias else 0),  # k_proj
        k + (kv * hd if qkv_bias else 0),  # v_proj
        heads * hd * h + (h if o_bias else 0),  # o_proj
        h * inter + (inter if mlp_bias else 0),  # gate_proj
        h * inter + (inter if mlp_bias else 0),  # up_proj
        inter * h + (h if mlp_bias else 0),  # down_proj
        h, h,  # input_layernorm, post_attention_layernorm
    ]
    tensors = [(q, 1), (k, 2), (heads * hd * h, 1), (h * inter, 3), (h, 2)]
    order = ((h, False), (q, True), (k, True), (k, True), (heads * hd * h, True), (h, False), (h * inter, True),
             (h * inter, True), (inter * h, True))
    if qkv_bias:
        tensors += [(heads * hd, 1), (kv * hd, 2)]
    if o_bias:
        tensors += [(h, 1)]
    if mlp_bias:
        tensors += [(inter, 2), (h, 1)]
    return tensors, modules, order


def _llama_matrices(cfg: dict) -> list[tuple[tuple[int, int], int]]:
    """One block's weight matrices as (shape [out, in], how many): q, k and v, o, gate and up, down."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    hd = cfg.get("head_dim") or h // heads
    return [((heads * hd, h), 1), ((kv * hd, h), 2), ((h, heads * hd), 1), ((inter, h), 2), ((h, inter), 1)]


def _llama_count(cfg: dict) -> ParamCount:
    h, vocab, layers = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    tied = cfg.get("tie_word_embeddings", False)
    tensors, modules, order = _llama_block(cfg)
    per_layer = sum(modules)
    embedding = vocab * h
    lm_head = 0 if tied else vocab * h
    hist = _sizes(*[(n, c * layers) for n, c in tensors], (embedding, 1 if tied else 2), (h, 1))
    o_bias = h if cfg.get("attention_bias", False) and cfg["model_type"] != "qwen2" else 0
    down_bias = h if cfg.get("mlp_bias", False) else 0
    return ParamCount(
        total=embedding + lm_head + h + layers * per_layer, num_layers=layers, per_layer=per_layer,
        embedding=embedding, lm_head=lm_head, other=h, largest_layer=max(modules + [embedding]),
        largest_tensor=max(hist), tensor_sizes=hist, per_layer_split=sum(modules[:7]) - o_bias - down_bias,
        block_tensors=order, muon_params=layers * sum(n * c for n, c in tensors[:4]),
        muon_shapes=tuple((shape, c * layers) for shape, c in _llama_matrices(cfg)))


def _gpt2_count(cfg: dict) -> ParamCount:
    h = cfg.get("n_embd", 768)
    vocab, layers = cfg.get("vocab_size", 50257), cfg.get("n_layer", 12)
    positions = cfg.get("n_positions", 1024)
    inter = cfg.get("n_inner") or 4 * h
    tied = cfg.get("tie_word_embeddings", True)
    modules = [2 * h, 3 * h * h + 3 * h, h * h + h, 2 * h, h * inter + inter, inter * h + h]
    per_layer = sum(modules)
    wte, wpe = vocab * h, positions * h
    lm_head = 0 if tied else vocab * h
    hist = _sizes((h, 6 * layers + 2), (3 * h * h, layers), (3 * h, layers), (h * h, layers),
                  (h * inter, 2 * layers), (inter, layers), (wte, 1 if tied else 2), (wpe, 1))
    return ParamCount(
        total=wte + wpe + lm_head + 2 * h + layers * per_layer, num_layers=layers, per_layer=per_layer,
        embedding=wte + wpe, lm_head=lm_head, other=2 * h, largest_layer=max(modules + [wte, wpe]),
        largest_tensor=max(hist), tensor_sizes=hist, positions=wpe,
        per_layer_split=per_layer - 4 * h - 2 * h,
        block_tensors=((h, False), (h, False), (3 * h * h, True), (3 * h, True), (h * h, True), (h, False),
                       (h, False), (h, False), (h * inter, True), (inter, True), (inter * h, True), (h, False)),
        # GPT-2 names its embeddings wte / wpe, so DeepSpeed's name test leaves them (and the tied head) on Muon
        muon_params=wte + wpe + layers * (4 * h * h + 2 * h * inter),
        muon_shapes=(((vocab, h), 1), ((positions, h), 1), ((h, 3 * h), layers), ((h, h), layers),
                     ((h, inter), layers), ((inter, h), layers)))  # ln_1, ln_2 and the two c_proj biases stay whole


DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "c_attn",
                        "c_proj", "c_fc")  # the recipe schema's adapter.target_modules default


def _projections(cfg: dict) -> list[tuple[str, int, int, bool]]:
    """(name, in_features, out_features, column-parallel?) of one block's projections."""
    if cfg.get("model_type") == "gpt2":
        h = cfg.get("n_embd", 768)
        inter = cfg.get("n_inner") or 4 * h
        return [("c_attn", h, 3 * h, True), ("c_proj", h, h, False), ("c_fc", h, inter, True),
                ("c_proj", inter, h, False)]
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv, hd = cfg.get("num_key_value_heads") or heads, cfg.get("head_dim") or h // heads
    inter = cfg["intermediate_size"]
    return [("q_proj", h, heads * hd, True), ("k_proj", h, kv * hd, True), ("v_proj", h, kv * hd, True),
            ("o_proj", heads * hd, h, False), ("gate_proj", h, inter, True), ("up_proj", h, inter, True),
            ("down_proj", inter, h, False)]


def with_lora(count: ParamCount, cfg: dict, r: int, targets=DEFAULT_LORA_TARGETS) -> ParamCount:
    """The count of the same model with rank-r LoRA adapters (A: r x in, B: out x r) on the target projections
    of every block; the base weights are then frozen and the adapters are all that trains."""
    from dataclasses import replace

    if cfg.get("model_type") not in CLOSED_FORM_FAMILIES:
        raise ValueError(f"LoRA counts need a known family ({', '.join(CLOSED_FORM_FAMILIES)}), "
                         f"got {cfg.get('model_type')!r}")
    chosen = [(n, i, o, col) for n, i, o, col in _projections(cfg) if n in targets]
    if not chosen:
        raise ValueError(f"no projection of {cfg.get('model_type')} matches target modules {list(targets)}")
    per_layer = sum(r * (i + o) for _, i, o, _ in chosen)
    split = sum(r * o if col else r * i for _, i, o, col in chosen)
    hist = dict(count.tensor_sizes)
    for _, i, o, _ in chosen:
        for numel in (r * i, r * o):
            hist[numel] = hist.get(numel, 0) + count.num_layers
    return replace(count, total=count.total + count.num_layers * per_layer, per_layer=count.per_layer + per_layer,
                   per_layer_split=count.per_layer_split + split, tensor_sizes=hist, lora_per_layer=per_layer,
                   lora_per_layer_split=split, lora_largest_tensor=max(r * max(i, o) for _, i, o, _ in chosen))


def _moe_count(cfg: dict) -> ParamCount:
    """Mixture-of-Experts families (moe/counts.py). As in meta_count, per_layer is the first block (DeepSeek-V3's
    first blocks are dense) and `other` what the blocks' count as num_layers x per_layer leaves out."""
    from harness.planner.moe.counts import moe_layout, moe_totals

    m = moe_layout(cfg)
    sums = moe_totals(m)
    t, layers = m["tensors"], m["moe_layers"] + m["dense_layers"]
    per_sparse = t["attention"] + t["norms"] + t["routed"] + t["router"] + t["shared"]
    per_dense = t["attention"] + t["norms"] + t["dense_mlp"]
    hist = _sizes(*[(n, m["moe_layers"]) for n in per_sparse], *[(n, m["dense_layers"]) for n in per_dense],
                  (m["embedding"], 1 if m["tied"] else 2), (m["final_norm"], 1))
    modules = [sum(t["routed"]), sum(t["router"]), m["embedding"]] + t["attention"] + t["dense_mlp"] + t["shared"]
    first = sums["moe_layer"] if m["sparse"][0] else sums["dense_layer"]
    lm_head = 0 if m["tied"] else m["embedding"]
    return ParamCount(
        total=sums["total"], num_layers=layers, per_layer=first, embedding=m["embedding"], lm_head=lm_head,
        other=sums["total"] - m["embedding"] - lm_head - layers * first, active_blocks=sums["active"] - (
            sums["total"] - m["moe_layers"] * sums["moe_layer"] - m["dense_layers"] * sums["dense_layer"]),
        largest_layer=max(modules), largest_tensor=max(hist), tensor_sizes=hist, num_experts=m["num_experts"],
        top_k=m["top_k"], active=sums["active"], routed_experts=sums["routed_experts"], moe_block=sums["moe_block"],
        moe_layers=m["moe_layers"])


def closed_form_count(cfg: dict) -> ParamCount | None:
    """Exact count for known families from the config alone; None for other architectures."""
    from harness.planner.moe.counts import is_moe

    family = cfg.get("model_type")
    if is_moe(cfg):
        return _moe_count(cfg)
    if family in LLAMA_LIKE:
        return _llama_count(cfg)
    if family == "gpt2":
        return _gpt2_count(cfg)
    return None


@contextlib.contextmanager
def outside_zero3():
    """transformers builds every model under deepspeed.zero.Init while a ZeRO-3 config is registered (a ZeRO-3
    rank's, harness/model/hf.py keeps it for the run), and zero.Init's weight init gathers: a count on the meta
    device inside a run would then be a collective on one rank only (a hang). Unregistered for the count, then put
    back (transformers keeps only a weak reference to it)."""
    from transformers.integrations import deepspeed as hf_deepspeed

    ref = hf_deepspeed._hf_deepspeed_config_weak_ref
    held = ref() if ref is not None else None
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        if held is not None:
            hf_deepspeed.set_hf_deepspeed_config(held)


def meta_count(cfg: dict) -> ParamCount:
    """What transformers builds from this config, counted on the meta device (no memory, no weights)."""
    import torch
    import transformers

    fields = dict(cfg)
    model_type = fields.pop("model_type", None)
    if not model_type:
        from harness.errors import UsageError

        raise UsageError("model config has no 'model_type': cannot tell which architecture to build")
    config = transformers.AutoConfig.for_model(model_type, **fields)
    auto = transformers.AutoModelForImageTextToText if cfg.get("vision_config") else transformers.AutoModelForCausalLM
    with outside_zero3(), torch.device("meta"):
        model = auto.from_config(config)  # a vision-language model: tower, projector and language model
    return count_module(model)


def count_module(model) -> ParamCount:
    """Count an nn.Module (meta or real) the way DeepSpeed sees it: tied parameters once."""
    from torch import nn

    unique = {id(p): p for p in model.parameters()}
    hist = _sizes(*[(p.numel(), 1) for p in unique.values()])
    largest_layer = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    blocks = max((m for m in model.modules() if isinstance(m, nn.ModuleList)),
                 key=lambda m: sum(p.numel() for p in m.parameters()), default=[])
    num_layers = len(blocks)
    per_layer = sum(p.numel() for p in blocks[0].parameters()) if num_layers else 0
    emb = model.get_input_embeddings()
    out = model.get_output_embeddings()
    embedding = emb.weight.numel() if emb is not None else 0
    position = getattr(getattr(model, "transformer", None), "wpe", None)
    positions = position.weight.numel() if position is not None else 0
    embedding += positions
    tied = out is None or emb is None or out.weight is emb.weight
    lm_head = 0 if tied else out.weight.numel()
    total = sum(p.numel() for p in unique.values())
    shapes: dict[tuple[int, ...], int] = {}
    for name, p in model.named_parameters():
        if muon_takes(name, p.dim()):
            shapes[tuple(p.shape)] = shapes.get(tuple(p.shape), 0) + 1
    muon = sum(math.prod(s) * c for s, c in shapes.items())
    return ParamCount(
        total=total, num_layers=num_layers, per_layer=per_layer, embedding=embedding, lm_head=lm_head,
        other=total - embedding - lm_head - num_layers * per_layer, largest_layer=largest_layer,
        largest_tensor=max(hist), tensor_sizes=hist, method="meta-device", positions=positions, muon_params=muon,
        muon_shapes=tuple(shapes.items()))


def muon_takes(name: str, ndim: int) -> bool:
    """Whether DeepSpeed 0.19.8's Muon steps this parameter (deepspeed.set_optimizer_flags): 2+ dimensions and a name
    without 'embed' or 'lm_head'; the rest go to its auxiliary AdamW."""
    return ndim >= 2 and not any(key in name.lower() for key in ("embed", "lm_head"))


def count_params(cfg: dict, *, exact: bool = False) -> ParamCount:
    """Closed form when the family is known (fast), else (or with exact=True) the meta-device count."""
    if not exact:
        fast = closed_form_count(cfg)
        if fast is not None:
            return fast
    return meta_count(cfg)


def model_shape(cfg: dict) -> ModelShape:
    """The shape fields the planner's activation and tensor-parallel math needs, any family."""
    from harness.model_shapes import shape_summary
    from harness.planner.moe.counts import is_moe, num_experts

    summary = shape_summary(cfg)
    missing = [k for k in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size")
               if not summary.get(k)]
    if missing:
        from harness.errors import UsageError

        raise UsageError(f"model config lacks {', '.join(missing)}: cannot size activations")
    gpt2 = summary["model_type"] == "gpt2"
    summary["num_key_value_heads"] = summary["num_key_value_heads"] or summary["num_attention_heads"]
    return ModelShape(
        **summary, head_dim=cfg.get("head_dim") or summary["hidden_size"] // summary["num_attention_heads"],
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gpt2)),  # GPT-2 ties by default
        dropout_masks=gpt2 and cfg.get("resid_pdrop", 0.1) > 0,
        max_positions=cfg.get("max_position_embeddings", cfg.get("n_positions")),
        learned_positions=gpt2, num_experts=num_experts(cfg) if is_moe(cfg) else 0)
