"""The model's shape as the planner reads it (ModelShape; params.model_shape builds it from an HF config)."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace


@dataclass(frozen=True)
class ModelShape:
    """The shape fields the planner's activation, tensor-parallel and step-time math needs, any family
    (params.model_shape reads them off an HF config)."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    num_hidden_layers: int
    intermediate_size: int  # a MoE model's dense MLP width (moe.activation_width: what a token's MLP holds)
    vocab_size: int
    model_type: str | None
    head_dim: int
    tie_word_embeddings: bool = False
    dropout_masks: bool = False  # GPT-2's resid_pdrop: bool masks after attention and MLP
    max_positions: int | None = None
    learned_positions: bool = False  # GPT-2's wpe: a longer sequence has no position vector
    num_experts: int = 0  # routed experts per sparse block (0: dense)
    vision: bool = False  # a vision-language model: a vision tower and projector beside the language model

    def but(self, **changes) -> "ModelShape":
        return replace(self, **changes)

    def to_dict(self) -> dict:
        """The plan's model "shape" (and model_shapes.tp_problems' input)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}
