"""Layouts a vision-language model (a config with a vision_config) cannot take, each with its own reason.

The harness's tensor-parallel plan, pipeline converter and Ulysses sequence parallelism are built for a causal LM's
decoder stack; a vision-language model adds a vision tower and a projector in front of it, and image tokens inside
the sequence. One pure function, asked by the recipe rules (harness validate, every launch), the run's checks
(train/vision_checks.py) and the planner's search (planner/layouts.not_applicable), so all three say the same.
"""

from __future__ import annotations

FIX = ("use ZeRO-3 instead (zero.stage=3, with offload_optimizer / offload_param cpu if it still does not fit): it "
       "shards the vision tower, the projector and the language model alike, and runs with images on some ranks only")

REASONS = {
    "tensor": "the tensor-parallel plan splits a causal LM's decoder layers only: the vision tower and the "
              "projector are not split by it (every tensor rank would hold and run them whole, saving nothing), "
              "and the harness builds no tensor-parallel model around them",
    "pipeline": "the pipeline converter cuts a causal LM's decoder layers into stages; a vision-language model's "
                "first stage would need the vision tower and projector to merge the image features into the "
                "embeddings, and the harness builds no pipeline layers for them",
    "sequence": "Ulysses sequence parallelism gives each rank a slice of every row's tokens: an image's span of "
                "tokens would be cut across ranks while the vision tower computes that image's features whole "
                "(and Qwen-VL's 3-D rotary positions come from the whole row)",
}


def layout_problems(model_type: str | None, degrees: dict[str, tuple[str, int]]) -> list[tuple[str, str, str]]:
    """(JSON path, what, fix) for each of degrees {"tensor" | "pipeline" | "sequence": (path, degree)} above 1."""
    kind = f" ({model_type})" if model_type else ""
    return [(path, f"{name} parallel degree {degree} for a vision-language model{kind}: {REASONS[name]}", FIX)
            for name, (path, degree) in degrees.items() if degree > 1]


def layout_refusal(model_type: str | None, tp: int, pp: int, sp: int) -> str | None:
    """The planner's reason a layout with these degrees is not built for a vision-language model, or None."""
    found = layout_problems(model_type, {"tensor": ("tp", tp), "pipeline": ("pp", pp), "sequence": ("sp", sp)})
    return "; ".join(what for _, what, _ in found) or None
