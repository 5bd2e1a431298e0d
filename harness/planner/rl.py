"""What online RL's generation costs one rank (train.objective grpo): the generator's gathered weights and KV cache,
decode and prefill time, the weight sync to a colocated vLLM, and the recommendation of a generator and a gather
group. Pure: counts and a hardware profile in, numbers out (harness/rl/generation/ runs what this prices).

Gathered weights under ZeRO-3 (rl.generator=hf, harness/rl/generation/gather.py). The bound counts the bytes
gathered beyond what ZeRO-3 keeps whole anyway (tensors at or under stage3_param_persistence_threshold):
- whole: every parameter gathered once per generate call; peak = the model's bytes;
- groups: the parameters outside the decoder layers (embeddings, head, final norm) for the whole call, plus one
  group of k consecutive layers at a time, k = floor((bound - outside) / layer); peak = persistent + outside + k x
  layer. Decode passes through every layer for every token, so each token re-gathers the layers: per token the
  rank receives (N-1)/N x layers' bytes in ceil(L / k) all-gathers, for all sequences of the batch at once.
Stages 0-2 hold whole weights: nothing is gathered.

KV cache = 2 x layers x kv_heads x head_dim x (prompt + completion) x sequences x bytes (K and V per layer).
Multi-turn rollouts (harness/rl/multiturn.py): turns = rl.max_tool_calling_iterations + 1 generate calls, each over
the prompt and the turns so far, its cache dropped at its end; max_completion_length counts the tool tokens, so the
largest call's cache is the single turn's. Of the completion, (turns - 1) x the tool-result budget (a round's
rendered tool messages) are tool tokens, prefilled by the next call, never decoded: decode steps = completion - tool
tokens (at least one sampled token per turn). A whole ZeRO-3 gather is paid once per generate call.
Decode is memory-bound: one pass over the weights per completion token (plus the cache read), at the profile's HBM
bandwidth; under grouped ZeRO-3 the per-token gather over the link is added. Prefill is compute-bound:
2 x params x prompt tokens x sequences flops.
The weight sync (rl.generator=vllm): every weight once per optimizer step in buckets of rl.sync_bucket_mb
gathered bytes; time = all-gather of the bucket + the copy into vLLM (HBM), no rank holding more than one bucket.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from harness.planner.params import ParamCount
from harness.planner.shape import ModelShape

GATHER_HEADROOM = 0.5  # of the free memory, what gathered weights may take (the rest: KV cache, logits, activations)
MIB = 1 << 20
GB = 1e9


@dataclass(frozen=True)
class GatherPlan:
    whole: bool
    layers_per_group: int
    num_groups: int
    persistent_bytes: int  # kept whole by ZeRO-3 anyway (every rank, always)
    outside_bytes: int  # gathered for the whole call: embeddings, head, final norm (non-persistent part)
    layer_bytes: int  # one decoder layer's non-persistent bytes
    peak_bytes: int  # whole-held parameter bytes at the generator's peak (persistent included)
    per_token_gather_bytes: int  # gathered again per completion token (0: once per call)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def zero3_pieces(count: ParamCount, *, lp: int, threshold: int, hidden: int) -> tuple[int, int, int]:
    """(persistent, outside, one layer) bytes: what ZeRO-3 keeps whole, the non-layer parameters it partitions, and
    one decoder layer's partitioned parameters. Outside the layers only the final norm (hidden-sized tensors) can
    be under the threshold."""
    persistent = count.persistent_numel(threshold)
    outside_small = count.other if hidden <= threshold else 0
    layer_small = (persistent - outside_small) // max(count.num_layers, 1)
    outside = count.embedding + count.lm_head + count.other - outside_small
    return lp * persistent, lp * outside, lp * (count.per_layer - layer_small)


def gather_plan(count: ParamCount, *, lp: int, threshold: int, hidden: int, bound_bytes: int | None,
                stage: int = 3) -> GatherPlan:
    """The generator's gathers under ZeRO-3 for a bound (None: whole), as generation/gather.py performs them."""
    if stage != 3:
        total = lp * count.total
        return GatherPlan(True, count.num_layers, 1, total, 0, 0, total, 0)
    persistent, outside, layer = zero3_pieces(count, lp=lp, threshold=threshold, hidden=hidden)
    layers = count.num_layers
    if bound_bytes is None or outside + layers * layer <= bound_bytes:
        return GatherPlan(True, layers, 1, persistent, outside, layer, persistent + outside + layers * layer, 0)
    k = max(1, min(layers, (bound_bytes - outside) // max(layer, 1)))
    groups = -(-layers // k)
    return GatherPlan(False, k, groups, persistent, outside, layer, persistent + outside + k * layer, layers * layer)


@dataclass(frozen=True)
class GatherChoice:
    whole: bool
    bound_bytes: int | None
    reason: str


def choose_gather(*, model_bytes: int, layer_bytes: int, free_bytes: int, headroom: float = GATHER_HEADROOM,
                  kv_bytes: int = 0) -> GatherChoice:
    """Whole when the gathered model and the KV cache fit in headroom x free memory; else layer groups in what
    is left of it (at least one layer)."""
    room = int(free_bytes * headroom) - kv_bytes
    if model_bytes <= room:
        return GatherChoice(True, None, f"the model's {model_bytes / MIB:.1f} MiB fit in {room / MIB:.1f} MiB")
    bound = max(room, layer_bytes)
    return GatherChoice(False, bound, f"the model's {model_bytes / MIB:.1f} MiB exceed {room / MIB:.1f} MiB "
                                      f"({headroom:g} x free - KV cache): layer groups within {bound / MIB:.1f} MiB")


def kv_cache_bytes(shape: ModelShape, *, sequences: int, tokens: int, lp: int) -> int:
    """2 x layers x kv_heads x head_dim x tokens x sequences x bytes."""
    return 2 * shape.num_hidden_layers * shape.num_key_value_heads * shape.head_dim * tokens * sequences * lp


def decode_s(*, weight_bytes: int, kv_bytes: int, completion_tokens: int, hbm_gbps: float,
             gather_bytes_per_token: int = 0, link_gbps: float = 0.0, world: int = 1) -> float:
    """Memory-bound decode: per completion token one pass over the weights and (on average) half the final cache,
    plus the per-token gather of grouped ZeRO-3 over the link ((N-1)/N of the layers' bytes per rank)."""
    per_token = (weight_bytes + kv_bytes / 2) / (hbm_gbps * GB)
    if gather_bytes_per_token and link_gbps:
        per_token += gather_bytes_per_token * (world - 1) / world / (link_gbps * GB)
    return completion_tokens * per_token


def prefill_s(*, params: int, prompt_tokens: int, sequences: int, flops: float) -> float:
    return 2.0 * params * prompt_tokens * sequences / flops


def prefill_tokens(*, prompt_len: int, completion_len: int, turns: int) -> int:
    """Tokens prefilled per sequence: each turn of a multi-turn rollout (harness/rl/multiturn.py) is a new generate
    call over the prompt and everything after it so far (no cache kept across turns): turns x prompt + the
    completion budget (tool tokens included) spread evenly over the turns, (turns - 1) / 2 x completion."""
    return turns * prompt_len + (turns - 1) * completion_len // 2


def sync_plan(*, total_params: int, lp: int, bucket_mb: float, world: int, link_gbps: float,
              hbm_gbps: float) -> dict:
    """The weight sync after each optimizer step: bytes, buckets, the most one rank holds, seconds."""
    total = total_params * lp
    bucket = max(int(bucket_mb * MIB), 1)
    gather_s = total * (world - 1) / world / (link_gbps * GB) if world > 1 else 0.0
    return {"bytes": total, "bucket_bytes": min(bucket, total), "buckets": -(-total // bucket),
            "peak_bytes": min(bucket, total), "seconds": gather_s + total / (hbm_gbps * GB)}


@dataclass(frozen=True)
class RolloutWork:
    """What one rank generates per step (plan --objective grpo)."""

    sequences: int  # completions this rank generates per generation (its share of the batch)
    prompt_len: int
    completion_len: int
    generator: str = "hf"  # hf | vllm
    gather_bound_bytes: int | None = None  # None: the planner chooses (choose_gather)
    sync_bucket_mb: float = 256.0
    vllm_memory_fraction: float = 0.3  # rl.vllm_gpu_memory_utilization (distill.vllm_gpu_memory_utilization)
    block: str = "rl"  # the recipe block whose keys the advice names: rl (grpo), distill (gkd, distill)
    turns: int = 1  # generate calls per rollout: rl.max_tool_calling_iterations + 1 (multi-turn), else 1
    tool_result_tokens: int = 0  # tokens one round of tool results adds (its rendered tool messages)


def turn_tokens(work: RolloutWork) -> tuple[int, int]:
    """(tool tokens, sampled tokens) per sequence at the budget: (turns - 1) x the tool-result budget, leaving at
    least one sampled token per turn; the rest of max_completion_length is sampled (decoded)."""
    tool = max(0, min((work.turns - 1) * work.tool_result_tokens, work.completion_len - work.turns))
    return tool, work.completion_len - tool


def rollout_plan(count: ParamCount, shape: ModelShape, work: RolloutWork, *, stage: int, world: int, lp: int,
                 threshold: int, free_bytes: int, gpu_mem_bytes: int, profile: dict) -> dict:
    """The generation's memory and time on one rank for a layout (stage over `world` ranks), with the gather the
    planner recommends when work.gather_bound_bytes is None, and the vLLM alternative beside it."""
    tokens = work.prompt_len + work.completion_len
    kv = kv_cache_bytes(shape, sequences=work.sequences, tokens=tokens, lp=lp)
    model_bytes = lp * count.total
    bound = work.gather_bound_bytes
    reason = "rl.gather_mb given"
    if bound is None and stage == 3:
        _, outside, layer = zero3_pieces(count, lp=lp, threshold=threshold, hidden=shape.hidden_size)
        choice = choose_gather(model_bytes=outside + count.num_layers * layer, layer_bytes=outside + layer,
                               free_bytes=free_bytes, kv_bytes=kv)
        bound, reason = choice.bound_bytes, choice.reason
    gather = gather_plan(count, lp=lp, threshold=threshold, hidden=shape.hidden_size, bound_bytes=bound, stage=stage)
    hbm, link = float(profile.get("hbm_gbps", 1000)), float(profile.get("intra_node_gbps", 100))
    flops = float(profile.get("peak_tflops", {}).get("bf16", 100)) * 1e12 * float(profile.get("gemm_efficiency", 0.5))
    tool_tokens, sampled = turn_tokens(work)
    hf_decode = decode_s(weight_bytes=model_bytes, kv_bytes=kv, completion_tokens=sampled,
                         hbm_gbps=hbm, gather_bytes_per_token=gather.per_token_gather_bytes, link_gbps=link,
                         world=world)
    whole_gather_s = work.turns * model_bytes * (world - 1) / world / (link * GB) if stage == 3 and gather.whole \
        else 0.0
    prefilled = prefill_tokens(prompt_len=work.prompt_len, completion_len=work.completion_len, turns=work.turns)
    prefill = prefill_s(params=count.total, prompt_tokens=prefilled, sequences=work.sequences, flops=flops)
    sync = sync_plan(total_params=count.total, lp=lp, bucket_mb=work.sync_bucket_mb, world=world if stage == 3
                     else 1, link_gbps=link, hbm_gbps=hbm)
    vllm_bytes = int(work.vllm_memory_fraction * gpu_mem_bytes)  # vLLM's gpu_memory_utilization: of the whole GPU
    hf_peak = (gather.peak_bytes - (gather.persistent_bytes if stage == 3 else model_bytes)) + kv
    return {"kv_cache_bytes": kv, "turns": work.turns, "prefill_tokens": prefilled, "tool_tokens": tool_tokens,
            "sampled_tokens": sampled, "gather": gather.to_dict(),
            "gather_reason": reason if stage == 3 else
            "stages 0-2 hold whole weights: nothing is gathered",
            "hf": {"extra_bytes": hf_peak, "prefill_s": prefill, "decode_s": hf_decode + whole_gather_s,
                   "per_token_gather_bytes": gather.per_token_gather_bytes},
            "vllm": {"bytes": model_bytes + kv, "budget_bytes": vllm_bytes,
                     "decode_s": decode_s(weight_bytes=model_bytes, kv_bytes=kv, completion_tokens=sampled,
                                          hbm_gbps=hbm),
                     "prefill_s": prefill, "sync": sync},
            "recommend": _recommend(work, gather, model_bytes, kv, vllm_bytes, free_bytes, hf_peak, gpu_mem_bytes)}


def _recommend(work: RolloutWork, gather: GatherPlan, model_bytes: int, kv: int, vllm_bytes: int, free_bytes: int,
               hf_extra: int, gpu_mem_bytes: int) -> str:
    if hf_extra > free_bytes:
        return (f"nothing fits: hf needs {hf_extra / MIB:.0f} MiB beyond training (KV cache + one layer group), "
                f"{free_bytes / MIB:.0f} MiB are free; fewer sequences per rank or a shorter max_completion_length")
    need = model_bytes + kv
    if need <= free_bytes and gpu_mem_bytes:
        share = min(1.0, math.ceil(20 * need / gpu_mem_bytes) / 20 + 0.05)  # in steps of 0.05, one step spare
        fits = vllm_bytes >= need and vllm_bytes <= free_bytes
        return (f"vllm (GPU): the model and KV cache ({need / MIB:.0f} MiB) fit the {free_bytes / MIB:.0f} MiB free "
                f"beside training; decode needs no per-token gathers"
                + ("" if fits else f"; set {work.block}.vllm_gpu_memory_utilization={share:g} "
                                    f"(now {work.vllm_memory_fraction:g})"))
    if gather.whole and not gather.outside_bytes:
        return "hf: this stage holds whole weights, generate runs on them"
    if gather.whole:
        return "hf, whole gather: the model fits beside training; one all-gather per generate call"
    return (f"hf, layer groups of {gather.layers_per_group} ({gather.num_groups} gathers per token over all "
            f"{work.sequences} sequences at once): the model does not fit whole")


def fit_rollouts(layouts: list[dict], count: ParamCount, shape: ModelShape, work: RolloutWork, *, gpu_mem_bytes: int,
                 lp: int, threshold: int, reserve: float, profile: dict,
                 async_on_gpu: bool = False) -> tuple[dict | None, dict | None]:
    """--recipe auto for an RL run: the first layout (in the planner's order, fitting for training) whose free memory
    beside training also holds the generation (KV cache and the gathered group; under rl.async on the GPU, the
    generator process's weights copy and KV cache); with its rollout plan."""
    for layout in layouts:
        if not layout.get("fits"):
            continue
        free = int(gpu_mem_bytes * (1 - reserve)) - int(layout["memory"]["gpu_bytes"])
        plan = rollout_plan(count, shape, work, stage=int(layout["zero_stage"]), world=int(layout["dp"]), lp=lp,
                            threshold=threshold, free_bytes=free, gpu_mem_bytes=gpu_mem_bytes, profile=profile)
        # rl.async on the GPU: the rank's generator process holds a weights copy and the KV cache beside training
        need = lp * count.total + plan["kv_cache_bytes"] if async_on_gpu else plan["hf"]["extra_bytes"]
        if need <= free:
            return layout, plan
    return None, None


def async_plan(*, model_bytes: int, kv_bytes: int, generate_s: float, train_s: float, sync_s: float,
               max_staleness: int, generators: int = 1, device: str = "cpu", free_bytes: int | None = None) -> dict:
    """rl.async (harness/rl/async_rollouts.py): each rank's generator process(es) hold a whole copy of the policy's
    weights and their own KV cache, on `device` (rl.async_generator_device resolved: "cuda", the trainer rank's own
    GPU, counted per GPU and fitted into `free_bytes`, what the layout leaves free beside training; "cpu", host
    memory), and the step overlaps generation with training: max(generate, train) + the weight sync, against
    generate + train + sync in a synchronous step (max_staleness 0 overlaps nothing)."""
    per_process = model_bytes + kv_bytes
    held = generators * per_process
    gpu = device == "cuda"
    serial = generate_s + train_s + sync_s
    overlapped = (max(generate_s, train_s) if max_staleness > 0 else generate_s + train_s) + sync_s
    return {"generators_per_rank": generators, "device": device, "bytes_per_process": per_process,
            "weights_bytes": model_bytes, "kv_cache_bytes": kv_bytes,
            "gpu_bytes_per_rank": held if gpu else 0, "host_bytes_per_rank": 0 if gpu else held,
            "free_bytes": free_bytes, "fits": not gpu or free_bytes is None or held <= free_bytes,
            "sync_step_s": serial, "async_step_s": overlapped, "gain": serial / overlapped if overlapped else 1.0,
            "bound": "generate" if generate_s > train_s else "train"}


def async_device(choice: str, trainer_device: str) -> str:
    """rl.async_generator_device for a plan whose ranks train on `trainer_device` (cuda | cpu): auto follows it."""
    return ("cuda" if trainer_device == "cuda" else "cpu") if choice == "auto" else choice
