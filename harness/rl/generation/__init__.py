"""Generators: completions from the policy's live weights (`rl.generator`).

The contract with the RL loop (train/):
- `make_generator(rl, engine, tokenizer, run) -> Generator`;
- `Generator.generate(prompt_ids, *, seed, first_row=0) -> list[list[int]]`: one completion per entry (the caller
  repeats each prompt num_generations times), token ids as generated without padding, at most
  rl.max_completion_length tokens, stopping at EOS per sequence (EOS included); deterministic given seed and
  weights: row i draws from the stream (seed, first_row + i), so passing the row's global index as first_row makes
  a completion independent of the world size; collective (every rank calls it, the same number of times);
- `Generator.after_step()` after each optimizer step (the weight sync; nothing for hf);
- `state_dict()` / `load_state_dict()`: the sampling state a checkpoint keeps.
"""

from __future__ import annotations

from typing import Protocol

from harness.errors import UsageError

MIB = 1 << 20


class Generator(Protocol):
    name: str

    def generate(self, prompt_ids: list[list[int]], *, seed: int, first_row: int = 0) -> list[list[int]]: ...

    def after_step(self) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def gather_bound_bytes(rl: dict, engine) -> int | None:
    """rl.gather_mb as bytes; "auto": the planner's choice for what this rank has free (None: the whole model)."""
    value = rl.get("gather_mb", "auto")
    if value != "auto":
        return int(float(value) * MIB)
    from harness.planner import rl as rl_plan
    from harness.rl.generation import gather, memory

    module = engine.module
    if not gather.is_zero3(module):
        return None
    layers = gather.decoder_layers(module)
    total = sum(map(gather.gathered_bytes, module.parameters()))
    per_layer = max(sum(map(gather.gathered_bytes, layer.parameters())) for layer in layers)
    choice = rl_plan.choose_gather(model_bytes=total, layer_bytes=per_layer, free_bytes=memory.free_bytes(),
                                   headroom=float(rl.get("gather_headroom", rl_plan.GATHER_HEADROOM)))
    return None if choice.whole else choice.bound_bytes


def generator_problems(recipe: dict) -> list:
    """Before launch (train/checks.py): rl.generator=vllm (or distill.use_vllm) on a machine without CUDA or vllm,
    with the reason."""
    from harness.errors import Problem

    rl, objective = recipe.get("rl") or {}, recipe.get("train", {}).get("objective")
    distill = objective in ("gkd", "distill") and (recipe.get("distill") or {}).get("use_vllm")
    if objective == "grpo" and rl.get("async"):
        return _async_device_problems(rl)
    if not distill and (objective != "grpo" or rl.get("generator") != "vllm" or rl.get("replay")):
        return []
    from harness.rl.generation.vllm import unavailable

    why = unavailable()
    if why and distill:
        return [Problem("distill.use_vllm", why.replace("rl.generator=vllm", "distill.use_vllm"), "run on a GPU "
                        "node with vllm installed, or set distill.use_vllm=false (HF generate on the live weights)")]
    return [Problem("rl.generator", why, "run on a GPU node with vllm installed, or set rl.generator=hf (HF generate "
                    "on the live weights, every stage)")] if why else []


def _async_device_problems(rl: dict) -> list:
    """rl.async_generator_device cuda where the ranks do not train on CUDA; the vLLM server (rl.vllm_mode server) where
    it cannot be used: no CUDA, no vllm or trl client, no server answering."""
    import torch
    from deepspeed.accelerator import get_accelerator

    from harness.errors import Problem
    from harness.rl.async_rollouts import async_device_problem

    cuda = torch.cuda.is_available() and get_accelerator().device_name() == "cuda"
    if rl.get("generator", "hf") == "vllm" and rl.get("vllm_mode", "colocate") == "server":
        from harness.rl.generation.vllm_server import SERVE, server_problem

        why = server_problem(rl, cuda)
        return [Problem("rl.vllm_mode", why, f"run the trainer on CUDA GPUs with vllm and trl installed, and start "
                        f"the server first on GPUs of its own ({SERVE}); or set rl.generator=hf")] if why else []
    why = async_device_problem(rl, cuda)
    return [Problem("rl.async_generator_device", why, "run on a GPU node, or set rl.async_generator_device=auto "
                    "(the trainer's device: CPU here) or cpu")] if why else []


def make_generator(rl: dict, engine, tokenizer, run=None) -> Generator:
    """The generator rl.generator names, on this rank's engine."""
    kind = rl.get("generator", "hf")
    seed = int(rl.get("seed", 0) or 0)
    if kind == "hf":
        from harness.rl.generation.hf import HFGenerator

        return HFGenerator(rl, engine, tokenizer, bound_bytes=gather_bound_bytes(rl, engine), seed=seed)
    if kind == "vllm":
        from harness.rl.generation.vllm import VLLMGenerator

        return VLLMGenerator(rl, engine, tokenizer, run=run, seed=seed)
    raise UsageError(f"rl.generator: {kind!r} is not a generator; fix: use hf or vllm (GPU)")
