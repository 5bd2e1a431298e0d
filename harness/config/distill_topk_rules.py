"""Rules of the top-k teacher modes (distill.teacher_mode precomputed, served; harness/distill/): what they cannot
take, refused before launch with the reason and the fix. Pure: the recipe only."""

from __future__ import annotations

from harness.errors import Problem

TOPK_MODES = ("precomputed", "served")


def topk_problems(recipe: dict, mode: str, settings: dict, on_policy: bool) -> list[Problem]:
    """mode: the resolved teacher mode; settings: the distill block with TRL's defaults filled; on_policy: whether
    some completions are generated during training."""
    block, out = recipe.get("distill", {}), []
    url = block.get("teacher_model_server_url")
    if url and mode != "served":
        out.append(Problem("distill.teacher_model_server_url", f"a teacher server ({url}) with teacher_mode {mode}: "
                           "the URL is read only by the served teacher",
                           "set distill.teacher_mode=served (or auto), or drop distill.teacher_model_server_url"))
    if mode not in TOPK_MODES:
        return out
    if mode == "served" and not url:
        out.append(Problem("distill.teacher_model_server_url", "teacher_mode served with no teacher server",
                           "set distill.teacher_model_server_url to the base URL of a vLLM server of the teacher "
                           "(`vllm serve MODEL --max-logprobs K`: http://HOST:PORT)"))
    if mode == "precomputed" and on_policy:
        out.append(Problem("distill.teacher_mode", "teacher_mode precomputed with on-policy completions (distill."
                           "lmbda > 0, seq_kd, or objective distill): the store holds the teacher's top-k for the "
                           "dataset's completions, written once before training, and on-policy completions are new "
                           "at every step", "use teacher_mode served or engine, or distill.lmbda=0 and seq_kd=false "
                           "with objective gkd"))
    beta, k = settings["beta"], settings["loss_top_k"]
    if beta is not None and beta > 0 and k > 1:
        has = "the precomputed store holds" if mode == "precomputed" else "the server returns"
        out.append(Problem("distill.loss_top_k", f"loss_top_k {k} with beta {beta} > 0 and teacher_mode {mode}: "
                           f"{has} only the teacher's top-k and the log-prob of the token actually there, while "
                           "the mixed and reverse divergences weigh the tokens the student puts mass on; TRL defines "
                           "them on the top-1 support only", "set distill.loss_top_k=1, or distill.beta=0 (forward KL "
                           "over the top-k), or teacher_mode engine (the whole vocabulary)"))
    return out
