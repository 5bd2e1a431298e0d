"""Hugging Face causal LM -> DeepSpeed PipelineModule, for the Llama family (Llama, Mistral, Qwen2) and GPT-2.

The pipe is a flat list of layers, each tensor in -> tensor out:
    embedding [+ GPT-2 positions] | one DecoderLayerPipe per decoder block | final norm | LM head
and the loss (HF's own ForCausalLMLoss: shifted, ignore_index -100, mean) runs on the last stage.

The wrappers hold the HF model's own submodules, so a pipe built from `models.build_model` has exactly the
weights of the single-process model (same seed, or the pretrained folder). Blocks need what the HF model's
forward computes once for all layers: position ids, the rotary (cos, sin) and the attention mask; each
DecoderLayerPipe recomputes them from the hidden states (cheap), so only the hidden states cross stages.
With sdpa attention and no padding mask the mask is None (is_causal); sliding-window layers get theirs.
Document packing (train.packing=document): the first stage gets (input_ids, position_ids) and every layer up to
the final norm passes (hidden, position_ids) on, so each stage's attention builds the per-document mask from the
same position ids (transformers detects the documents from them) and rotary/GPT-2 positions restart per document.

A tied LM head (config.tie_word_embeddings) is a TiedLayerSpec "embed": the first stage's embedding and the
last stage's head hold copies of one weight whose gradients DeepSpeed all-reduces between the two stages.
"""

from __future__ import annotations

import torch
from torch import nn

from harness.errors import UsageError
from harness.model_shapes import PIPELINE_FAMILIES

DECODER = "DecoderLayerPipe"  # class name: activation checkpointing and partition_method "type:..." match it
TIED_KEY = "embed"


def supported(config) -> str:
    """The layer family of an HF config ("llama" or "gpt2"); UsageError naming what is supported otherwise."""
    model_type = getattr(config, "model_type", None)
    if model_type not in PIPELINE_FAMILIES:
        raise UsageError(f"model type {model_type!r} cannot be split into pipeline stages by the harness; supported "
                         f"model types: {', '.join(sorted(PIPELINE_FAMILIES))}\n"
                         "    fix: use one of those models, or a recipe without parallel.pipeline")
    return PIPELINE_FAMILIES[model_type]


class EmbedPipe(nn.Module):
    """Token ids -> embeddings (also the tied LM head's weight holder on the last stage)."""

    def __init__(self, embed: nn.Embedding):
        super().__init__()
        self.embed = embed

    def forward(self, inputs):
        if isinstance(inputs, (tuple, list)):  # document packing: (input_ids, position_ids)
            return self.embed(inputs[0]), inputs[1]
        return self.embed(inputs)


def _split(inputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(hidden, position_ids or None) of what a pipe layer received."""
    return (inputs[0], inputs[1]) if isinstance(inputs, (tuple, list)) else (inputs, None)


def _positions(hidden, given):
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0) if given is None else given


class PositionPipe(nn.Module):
    """GPT-2: add the learned position embeddings, then the embedding dropout (as GPT2Model.forward)."""

    def __init__(self, wpe: nn.Embedding, drop: nn.Module):
        super().__init__()
        self.wpe, self.drop = wpe, drop

    def forward(self, inputs):
        hidden, given = _split(inputs)
        out = self.drop(hidden + self.wpe(_positions(hidden, given)))
        return out if given is None else (out, given)


def _mask_function(config, index: int):
    """The mask builder the HF model uses for decoder layer `index` (sliding window or plain causal)."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        sliding = layer_types[index] == "sliding_attention"
    else:
        sliding = config.model_type == "mistral" and getattr(config, "sliding_window", None) is not None
    return create_sliding_window_causal_mask if sliding else create_causal_mask


class DecoderLayerPipe(nn.Module):
    """One HF decoder block; recomputes position ids, rotary embeddings and mask from the hidden states."""

    def __init__(self, layer: nn.Module, config, index: int, rotary: nn.Module | None = None):
        super().__init__()
        self.layer, self.rotary, self.config = layer, rotary, config
        self.mask_function = _mask_function(config, index)

    def forward(self, inputs):
        hidden, given = _split(inputs)
        positions = _positions(hidden, given)
        mask = self.mask_function(config=self.config, inputs_embeds=hidden, attention_mask=None, cache=None,
                                  position_ids=positions)
        extra = {} if self.rotary is None else {"position_embeddings": self.rotary(hidden, positions)}
        out = self.layer(hidden, attention_mask=mask, position_ids=positions, **extra)
        out = out[0] if isinstance(out, tuple) else out
        return out if given is None else (out, given)


class NormPipe(nn.Module):
    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm

    def forward(self, inputs):
        return self.norm(_split(inputs)[0])  # the position ids end here


class HeadPipe(nn.Module):
    """Untied LM head."""

    def __init__(self, head: nn.Linear):
        super().__init__()
        self.head = head

    def forward(self, hidden):
        return self.head(hidden)


def tied_head(module: EmbedPipe, hidden):
    """The tied LM head: logits from the embedding matrix (no bias, as HF's tied lm_head)."""
    return torch.nn.functional.linear(hidden, module.embed.weight)


def causal_lm_loss(logits, labels):
    """HF's own causal-LM loss, so the pipe's loss is the HF model's loss on the same batch (0, not NaN, when
    no token of the micro-batch is a target, as in trainer._forward)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    from harness.data.rows import loss_items

    return ForCausalLMLoss(logits, labels, vocab_size=logits.shape[-1], num_items_in_batch=loss_items(labels))


def _is_tied(model) -> bool:
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    return head is not None and head.weight is embed.weight


def layer_specs(model) -> list:
    """The pipe's layers as LayerSpecs around the HF model's submodules (built on the stage that owns them)."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    family = supported(model.config)
    config, base = model.config, model.base_model
    embed, tied = model.get_input_embeddings(), _is_tied(model)
    attr = "embed.weight"
    specs = [TiedLayerSpec(TIED_KEY, EmbedPipe, embed, tied_weight_attr=attr) if tied else LayerSpec(EmbedPipe, embed)]
    if family == "gpt2":
        specs.append(LayerSpec(PositionPipe, base.wpe, base.drop))
        blocks, norm, rotary = base.h, base.ln_f, None
    else:
        blocks, norm, rotary = base.layers, base.norm, base.rotary_emb
    specs += [LayerSpec(DecoderLayerPipe, block, config, i, rotary) for i, block in enumerate(blocks)]
    specs.append(LayerSpec(NormPipe, norm))
    specs.append(TiedLayerSpec(TIED_KEY, EmbedPipe, embed, forward_fn=tied_head, tied_weight_attr=attr) if tied
                 else LayerSpec(HeadPipe, model.get_output_embeddings()))
    return specs


def hf_names(specs: list, model) -> list[dict[str, str]]:
    """Per pipe layer: its state-dict keys -> the HF model's parameter names (what export writes)."""
    owner: dict[int, str] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        owner.setdefault(id(tensor), name)  # a tied weight keeps its first name (the input embedding)
    return [{key: owner[id(t)] for key, t in spec.build().state_dict(keep_vars=True).items()} for spec in specs]


def check_partition_method(method: str, specs: list) -> None:
    """DeepSpeed's methods: parameters, uniform, type:<regex> over layer class names (balances the matches)."""
    import re

    names = [s.typename.__name__ for s in specs]
    if method.lower() in ("parameters", "uniform"):
        return
    if method.lower().startswith("type:"):
        try:
            if any(re.search(method[5:], n, re.IGNORECASE) for n in names):
                return
        except re.error:
            pass
    raise UsageError(f"parallel.partition_method {method!r}: expected parameters, uniform or type:<regex> matching "
                     f"some of this model's pipe layers ({', '.join(dict.fromkeys(names))})\n"
                     f"    fix: --set parallel.partition_method=type:{DECODER} (balance decoder layers) or parameters")


def _stage_module_class():
    """PipelineModule that calls `on_stage(self)` once DeepSpeed has built this rank's layers and before its
    __init__ moves them to the device (`self.to(device)` cannot copy a meta tensor): the one moment a stage
    built on meta can be split and materialised with the partition DeepSpeed chose."""
    from deepspeed.pipe import PipelineModule

    class StagePipelineModule(PipelineModule):
        def __init__(self, *args, on_stage=None, **kwargs):
            object.__setattr__(self, "_on_stage", on_stage)
            super().__init__(*args, **kwargs)

        def _build(self):
            super()._build()
            if self._on_stage is not None:
                self._on_stage(self)

        def _count_layer_params(self):
            """partition_method "parameters" weighs every parameter: DeepSpeed counts only those that require grad,
            which with LoRA frozen early would balance the stages by adapter size. Full fine-tuning: its counts."""
            return [sum(p.numel() for p in (s.build() if hasattr(s, "build") else s).parameters())
                    if isinstance(s, nn.Module) or hasattr(s, "build") else 0 for s in self._layer_specs]

    return StagePipelineModule


def build_module(model, topology, partition_method: str, checkpoint_interval: int, on_stage=None):
    """(PipelineModule over `topology` holding the HF model's weights, its layer specs); this rank builds its
    stage only. `model` may be on meta: `on_stage(module)` then splits and materialises the stage's layers."""
    from deepspeed.runtime.activation_checkpointing.checkpointing import non_reentrant_checkpoint

    # Non-reentrant recomputation of decoder layers only: reentrant checkpointing of the embedding would drop
    # its gradients (its input, token ids, needs no grad).
    specs = layer_specs(model)
    check_partition_method(partition_method, specs)
    module = _stage_module_class()(layers=specs, topology=topology, loss_fn=causal_lm_loss,
                                   partition_method=partition_method,
                                   activation_checkpoint_interval=checkpoint_interval,
                                   activation_checkpoint_func=non_reentrant_checkpoint,
                                   checkpointable_layers=[DECODER], on_stage=on_stage)
    return module, specs


def local_decoder_layers(module) -> list[nn.Module]:
    """The HF decoder blocks this rank's stage holds (what tensor parallelism shards)."""
    return [f.layer for f in module.forward_funcs if isinstance(f, DecoderLayerPipe)]


def layout(module, specs: list, names: list[dict[str, str]]) -> dict:
    """The partition for the manifest: layer -> stage, each layer's type and HF parameter names."""
    parts = [int(p) for p in module.parts]
    return {"parts": parts, "layers": [{"index": i, "stage": int(module.stage_owner(i)), "type": s.typename.__name__,
                                        "tied": getattr(s, "key", None), "hf_names": names[i]}
                                       for i, s in enumerate(specs)]}
