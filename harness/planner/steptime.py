"""Step time of one layout on one hardware profile: compute, exposed communication, pipeline bubble, offload.

Pure arithmetic on the model shape and the profile (no torch). Every term, its formula and its source:

Compute (per rank, per micro-batch, on the slowest pipeline stage). With t tokens per micro-batch, a block
holding P_b matmul parameters on this tensor-parallel rank, d_attn = heads x head_dim, s the sequence:
    forward  F = t * (2 P_b + 4 s d_attn / tp)   per block     (2 FLOPs per multiply-add; QK^T and AV over
                                                                 the full s x s, no causal halving: Megatron's
                                                                 and PaLM's convention, 2104.04473 s5.1)
             + t * 2 h V / tp_head               LM head on the last stage
    backward 2 F (the gradients of inputs and of weights; with LoRA the frozen weights' gradient GEMMs, 2 t P
    of the frozen matmuls and the head, are skipped); recompute with activation checkpointing: one
    more forward of the blocks (not the head), as Megatron's and HF's full recomputation do. This is
    Megatron's hardware-FLOPs count 96 B s l h^2 (1 + s/6h + V/16lh) for a GPT shape, term by term.
    time = FLOPs / (peak x gemm_efficiency): one efficiency constant per profile (the elementwise work is
    inside it).
Model FLOPs (for MFU) leave the recompute out: 72 B s l h^2 (1 + s/6h + V/12lh) for a GPT shape.

Tensor parallel (Megatron f/g, 1909.08053 s3): per block and micro-batch two all-reduces of t x h in
forward, two in backward, two more when the forward is recomputed; they sit on the critical path (each
feeds the next matmul), so they add to the compute time.

Ulysses sequence parallel (planner/sequence.py; ALST, arXiv 2506.13996): each rank computes seq_len x micro /
sp tokens' matmuls and attention over the whole sequence for heads / sp (the same FLOPs per rank as its share);
the four all-to-alls per block and pass (forward, backward, recompute) block the attention, so they add to the
compute time; tiled MLP runs the MLP's forward once more in backward.

Pipeline (DeepSpeed's TrainSchedule is 1F1B without interleaving; Narayanan et al. 2104.04473 s2.2.1):
    step = (m + p - 1) x (t_f + t_b) of the slowest stage, i.e. the bubble (p - 1)/(m + p - 1) of the step;
    Megatron's interleaved schedule with v model chunks per stage shrinks the bubble term to (p - 1)/v
    (2104.04473 s2.2.2): `interleave` is for checking published Megatron runs only, DeepSpeed cannot run it.
    p2p: each of the m + p - 1 slots of the critical path sends one activation forward and one gradient
    back, t x h (/ tp in 3D, rebuilt by an all-gather over tp) over the stage link, blocking in DeepSpeed.

Data parallel (ZeRO), exposed time. DeepSpeed 0.19.8 (deepspeed-facts.md, planner/comm.py for bytes):
    ZeRO-0   gradients all-reduced after backward at the boundary (engine.allreduce_gradients): exposed.
    ZeRO-1/2 reduced in buckets from backward hooks; with overlap_comm on a side stream they overlap the
             backward (ZeRO-1 only the boundary micro-step's, ZeRO-2 every micro-step's); the last bucket
             waits for the last gradient, so at least one bucket is exposed. The all-gather of the updated
             partitions after the step is exposed.
    ZeRO-3   parameters all-gathered per module in forward and backward with prefetch (overlaps the
             compute of the module before), gradients reduce-scattered per bucket in backward; exposed =
             what exceeds the compute it hides behind, plus the first gather and the last bucket.
    pipeline the pipe engine reduces gradients after the whole schedule: exposed.
  On a profile with comm_overlap false (DeepSpeed's CPU accelerator: its streams are no-ops, gloo blocks
  the rank), every collective is exposed.
  Calls: ZeRO-0 reduces in 500M-element buckets (one call for most models); ZeRO-1/2/3 flush a reduce bucket
  (reduce_bucket_size) whenever the next gradient would overflow it, filled in backward order (reduce_calls:
  DeepSpeed's stage_1_and_2 / stage3 reduce_independent_p_g_buckets_and_remove_grads logic over the block's
  tensors); ZeRO-3 gathers once per module holding non-persistent parameters; the ZeRO-1/2 all-gather after
  the step runs in allgather_bucket_size (2e8) pieces. The number of calls and their size price each call on a
  calibrated curve (collectives.py). Measured on 2 gloo ranks (24M Llama, bucket 512^2): 69 reduce calls per
  step, 67 ZeRO-3 gathers; this model: 68 and 58.
  ZeRO hooks (calibrated profiles only): what ZeRO's per-parameter gradient hooks and ZeRO-3's per-module
  fetch/release cost beyond their collectives, per parameter tensor and micro-step, as `harness calibrate`
  measured on a real engine (zero_overhead_s_per_tensor); named GPU profiles carry none.

Optimizer step: on the device, memory bound: 30 B per parameter touched (fp32 param, grad, m, v read;
param, m, v written; the 16-bit copy), over hbm_gbps; on a calibrated profile the rate `harness calibrate`
measured for a real engine's step at this ZeRO stage (optimizer_params_per_s: gradient clipping, the mixed
precision wrapper's copies and the fused Adam kernel, all ranks stepping at once; offloaded: a ZeRO-2 engine
with DeepSpeedCPUAdam, its copies included). Offloaded (ZeRO-Offload,
Ren et al. 2101.06840): DeepSpeedCPUAdam at cpu_adam_params_per_s per node, shared by its ranks; gradients
go down and updated 16-bit parameters come up over PCIe (pcie_gbps per GPU; the down copy overlaps backward
where the profile overlaps); ZeRO-3 parameters on the CPU cross PCIe before every gather (forward and
backward). NVMe (ZeRO-Infinity, Rajbhandari et al. 2104.07857): the fp32 optimizer states of the node's
ranks are read and written once per step (16 B read, 12 B written per parameter) and parameters on NVMe are
read twice per micro-step, at nvme_read_gbps / nvme_write_gbps per node.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.config.defaults import ALLGATHER_BUCKET_ELEMS, PRECISION_BYTES, ZERO0_ALLREDUCE_BUCKET_ELEMS
from harness.planner import collectives, comm, hardware, memory, reference, sequence, teacher
from harness.planner.inputs import Cluster, Workload
from harness.planner.shape import ModelShape

OPT_STATE_READ_BYTES = 16  # fp32 master, exp_avg, exp_avg_sq, fp32 gradient
OPT_STATE_WRITE_BYTES = 12  # fp32 master, exp_avg, exp_avg_sq


MASKED = ("sdpa", "eager")  # attention given a materialised s x s mask (planner/activations.py's mask terms)


MASKED_DEFAULT = 2.0  # every score against the causal kernel's half, where the profile did not measure it


def block_flops_per_token(count, shape: ModelShape, seq_len: int, tp: int, masked: float = 1.0) -> float:
    """Forward FLOPs of one block per token on one tensor-parallel rank, in causal-kernel equivalents. `masked`:
    the attention gets a materialised s x s mask (sdpa with the document mask, the harness's document_sdpa,
    eager), so its kernel computes every score and reads the mask, where the causal mask-free kernel `harness
    calibrate` times for the efficiency (and every causal flash kernel) skips the upper half: the attention term
    is multiplied by the profile's masked_attention_factor (calibrate measures it: masked over causal sdpa
    forward + backward at the model's shape; 2.98 on this CPU, torch 2.13, s 4096, 2 heads of 16), default 2."""
    d_attn = shape.num_attention_heads * shape.head_dim
    attention = 4 * seq_len * d_attn / tp * masked
    return 2 * count.block_active(tp) + attention  # MoE: the parameters a token goes through


def head_flops_per_token(shape: ModelShape) -> float:
    return 2 * shape.hidden_size * shape.vocab_size


def model_flops_per_step(count, shape: ModelShape, seq_len: int, tokens: int) -> float:
    """Training model FLOPs per step (forward + backward, no recompute), the whole model."""
    blocks = count.num_layers * block_flops_per_token(count, shape, seq_len, 1)
    return 3 * tokens * (blocks + head_flops_per_token(shape))


def elementwise_bytes_per_token(shape: ModelShape, work: Workload, tp: int) -> float:
    """Bytes of activations one block writes per token in forward (memory.py's count of what backward keeps;
    with attention "materialized", Megatron's s x s scores: softmax output, dropout mask and output, 5 a s
    bytes, Korthikanti et al. 2205.05198 eq. 1)."""
    from harness.planner.memory import _layer_token_elems

    lp = PRECISION_BYTES[work.precision]
    scores = 5 * shape.num_attention_heads * work.seq_len / tp if work.attention == "materialized" else 0
    return lp * _layer_token_elems(shape, tp) + scores


def compute_s(count, shape: ModelShape, profile: dict, work: Workload, tp: int, blocks: int, head: bool) -> dict:
    """Forward, backward and recompute seconds of one micro-batch on one rank holding `blocks` blocks: the
    matmuls at the achieved FLOP/s plus the memory-bound elementwise work (norms, activations, softmax,
    dropout), which reads and writes every saved activation: written in forward, read and its gradient
    written and read in backward (3 passes over hbm_gbps), once more when recomputed."""
    tokens = work.seq_len * work.micro_batch
    rate = hardware.achieved_flops(profile, work.precision)
    masked = profile.get("masked_attention_factor", MASKED_DEFAULT) if work.attention in MASKED else 1.0
    block = tokens * blocks * block_flops_per_token(count, shape, work.seq_len, tp, masked=masked)
    fwd = block + (tokens * head_flops_per_token(shape) / tp if head else 0.0)
    elem = tokens * blocks * elementwise_bytes_per_token(shape, work, tp) / (profile["hbm_gbps"] * 1e9)
    recompute = block / rate + elem if work.activation_checkpointing else 0.0
    # frozen weights (LoRA) get no weight gradient: backward skips those GEMMs (2 FLOPs per weight per token)
    frozen = 0.0
    if count.lora_per_layer:
        lora = count.lora_per_layer - count.lora_per_layer_split + count.lora_per_layer_split // tp
        frozen = 2 * tokens * (blocks * (count.block_params(tp) - lora) + (head_params(shape, tp) if head else 0))
    return {"forward": fwd / rate + elem, "backward": (2 * fwd - frozen) / rate + 2 * elem, "recompute": recompute}


def head_params(shape: ModelShape, tp: int) -> float:
    return shape.hidden_size * shape.vocab_size / tp


def _placement(c, cluster: Cluster) -> dict[str, tuple[int, bool]]:
    """(stride, spans nodes?) per group name used in the comm rows."""
    gpn, shards = cluster.gpus_per_node, cluster.world // (c.tp * c.pp)  # the "dp" group: ZeRO's, sp ranks included
    strides = {"tp": 1, "tp-pipe": 1, "dp": c.tp, "pp": c.tp * shards, "pp-tied": c.tp * shards * max(c.pp - 1, 1),
               "sp": 1,
               "ep": 1, "edp": c.ep}  # expert parallel: ep neighbouring ranks; the same experts every ep-th rank
    sizes = {"tp": c.tp, "tp-pipe": c.tp, "dp": shards, "pp": c.pp, "pp-tied": 2, "sp": c.sp, "ep": c.ep,
             "edp": shards // c.ep}
    return {g: (strides[g], collectives.spans_nodes(strides[g], sizes[g], gpn)) for g in strides}


def _row_s(profile: dict, row: dict, inter: bool, calls: int = 1) -> float:
    size = 2 if row["collective"] in ("send", "recv") else row["group_size"]
    return collectives.collective_s(profile, row["collective"], row["logged_bytes"], size, inter=inter,
                                    calls=calls)


def rank_tensors(count, blocks: int, tp: int, head: bool = True) -> list[int]:
    """Numel of the weight tensors a rank holding `blocks` blocks steps, in the order backward reaches them."""
    if count.block_tensors:
        block = [n // tp if split else n for n, split in count.block_tensors]
    else:  # a meta-device count: the histogram's tensors spread evenly over the blocks
        per = max(1, sum(count.tensor_sizes.values()) // max(count.num_layers, 1))
        block = [max(1, count.per_layer // per)] * per
    outer = ([count.lm_head] if head and count.lm_head else []) + [count.other]
    return [n for n in outer + list(reversed(block)) * blocks + [count.embedding] if n]


def reduce_calls(tensors: list[int], bucket_elems: int) -> int:
    """Reduce calls of one backward: a bucket is flushed when the next gradient would overflow it."""
    calls, filled = 0, 0
    for n in tensors:
        if filled and filled + n > bucket_elems:
            calls, filled = calls + 1, 0
        filled += n
    return calls + (1 if filled else 0)


def dp_calls(c, count, blocks: int, m: int, buckets, threshold: int, gathers: int = 1) -> dict[str, int]:
    """Calls per step of each data-parallel collective of layout `c` (the rows' logged bytes are per step)."""
    tensors = rank_tensors(count, blocks, c.tp)
    if c.stage == 0 or c.pp > 1:
        return {"all_reduce": max(1, -(-sum(tensors) // ZERO0_ALLREDUCE_BUCKET_ELEMS))}
    reduce = reduce_calls(tensors, buckets.reduce_bucket_elems) * (1 if c.stage == 1 else m)
    if c.stage in (1, 2):
        return {"all_reduce": reduce, "reduce_scatter_tensor": reduce,
                "all_gather_into_tensor": max(1, -(-sum(tensors) // (ALLGATHER_BUCKET_ELEMS * max(1, c.tp))))}
    gathered = sum(1 for n in tensors if n > threshold)
    return {"reduce_scatter_tensor": reduce, "all_reduce": reduce, "all_gather_into_tensor": gathered * gathers * m}


def _dp_exposed(c, rows: list[dict], profile: dict, inter: bool, t_mb: dict, m: int, bucket_bytes: float,
                calls: dict[str, int] | None = None) -> dict:
    """Exposed seconds per step of the data-parallel collectives."""
    calls = calls or {}
    times = {r["collective"]: _row_s(profile, r, inter, calls.get(r["collective"], 1)) for r in rows}
    reduce = times.get("all_reduce", 0.0) + times.get("reduce_scatter_tensor", 0.0)
    gather = times.get("all_gather_into_tensor", 0.0)
    total = reduce + gather
    if not profile["comm_overlap"] or c.stage == 0 or c.pp > 1:
        return {"dp_reduce": reduce, "dp_gather": gather, "dp_total": total}
    grads = sum(r["logged_bytes"] for r in rows if r["collective"] in ("all_reduce", "reduce_scatter_tensor"))
    last_bucket = reduce * min(1.0, bucket_bytes / grads) if grads else 0.0
    window = t_mb["backward"] + t_mb["recompute"]
    if c.stage in (1, 2):
        reducing_steps = 1 if c.stage == 1 else m
        per_step = reduce / reducing_steps
        exposed = reducing_steps * max(last_bucket / reducing_steps, per_step - window)
        return {"dp_reduce": exposed, "dp_gather": gather, "dp_total": total}
    per_step_reduce, per_step_gather = reduce / m, gather / m  # ZeRO-3: gathers split forward / backward
    exposed = m * (max(0.0, per_step_gather / 2 - t_mb["forward"])
                   + max(0.0, per_step_reduce + per_step_gather / 2 - window))
    first = per_step_gather / 2 / max(1, c.pp)  # nothing to hide the first module's gather behind
    return {"dp_reduce": exposed + last_bucket, "dp_gather": first, "dp_total": total}


def _offload_s(c, profile: dict, cluster: Cluster, work: Workload, shard: int, m: int, t_mb: dict) -> dict:
    lp = PRECISION_BYTES[work.precision]
    gpn, pcie = cluster.gpus_per_node, profile["pcie_gbps"] * 1e9
    out = {"optimizer": 0.0, "pcie": 0.0, "nvme": 0.0}
    if c.offload_optimizer == "none":
        measured = hardware.measured(profile, "optimizer_params_per_s").get(str(c.stage))
        out["optimizer"] = shard / (measured or hardware.device_adam_params_per_s(profile))
    else:
        measured = hardware.measured(profile, "optimizer_params_per_s").get("2-offload")
        out["optimizer"] = shard / measured if measured else shard * gpn / profile["cpu_adam_params_per_s"]
        down = m * lp * shard / pcie  # each micro-step's gradient partition goes to the CPU buffer
        hidden = m * (t_mb["backward"] + t_mb["recompute"]) if profile["comm_overlap"] else 0.0
        out["pcie"] = max(0.0, down - hidden) + lp * shard / pcie  # grads down, updated params up
    if c.offload_param != "none":
        fetch = 2 * m * lp * shard
        out["pcie"] += fetch / pcie
        if c.offload_param == "nvme":
            out["nvme"] += fetch * gpn / (profile["nvme_read_gbps"] * 1e9)
    if c.offload_optimizer == "nvme":
        out["nvme"] += shard * gpn * (OPT_STATE_READ_BYTES / (profile["nvme_read_gbps"] * 1e9)
                                      + OPT_STATE_WRITE_BYTES / (profile["nvme_write_gbps"] * 1e9))
    return out


def _stage_compute(c, count, shape: ModelShape, profile: dict, work: Workload, result: dict, stage_blocks) -> dict:
    """Compute of one micro-batch on the slowest stage (the last holds the LM head)."""
    if c.pp == 1:
        return compute_s(count, shape, profile, work, c.tp, count.num_layers, True)
    return max(stage_computes(c, count, shape, profile, work, result, stage_blocks), key=lambda t: sum(t.values()))


def stage_computes(c, count, shape: ModelShape, profile: dict, work: Workload, result: dict,
                   stage_blocks=None) -> list[dict]:
    """Compute of one micro-batch on every pipeline stage."""
    blocks = stage_blocks or [s["blocks"] for s in result["stages"]]
    return [compute_s(count, shape, profile, work, c.tp, b, i == len(blocks) - 1) for i, b in enumerate(blocks)]


@dataclass(frozen=True)
class Megatron:
    """A published Megatron run's pipeline schedule, for checking those runs only (DeepSpeed runs neither):
    interleave model chunks per stage (module doc), and the blocks of each stage (Megatron splits them evenly;
    None: the planner's own partition, result["stages"])."""

    interleave: int = 1
    stage_blocks: tuple[int, ...] | None = None


def step_time(c, count, shape: ModelShape, profile: dict, cluster: Cluster, work: Workload, result: dict,
              megatron: Megatron = Megatron()) -> dict:
    """Predicted seconds per optimizer step of layout `c` (a layouts.Candidate) with `result` its memory and
    comm evaluation (layouts.evaluate): the total, tokens/s per GPU, MFU and the breakdown."""
    m, world = result["micro_batches"], cluster.world
    interleave, stage_blocks = megatron.interleave, megatron.stage_blocks
    work = _sequence_work(c, work)
    t_mb = _stage_compute(c, count, shape, profile, work, result, stage_blocks)
    if c.tiled:  # TiledMLP runs the MLP's forward again in backward (ALST s3.3)
        t_mb["recompute"] += tiled_mlp_recompute_s(shape, profile, work, c.tp, result.get("blocks_per_rank", 1))
    place, by_group = _placement(c, cluster), _rows_by_group(result["comm"]["rows"])
    tp_calls = (6 if work.activation_checkpointing else 4) * m * result.get("blocks_per_rank", count.num_layers)
    tp_s = sum(_row_s(profile, r, place["tp"][1], tp_calls) for r in by_group.get("tp", []))
    tp_s += sum(_row_s(profile, r, place["tp-pipe"][1]) for r in by_group.get("tp-pipe", []))
    sp_calls = sequence.a2a_calls(result.get("blocks_per_rank", count.num_layers), m, work.activation_checkpointing)
    sp_s = sum(_row_s(profile, r, place["sp"][1], sp_calls) for r in by_group.get("sp", []))
    slot = sum(t_mb.values()) + tp_s / m
    slots = m + (c.pp - 1) / interleave
    p2p_s = _p2p_s(c.pp, profile, by_group.get("pp", []), place["pp"][1], m) if c.pp > 1 else 0.0
    buckets = memory.harness_buckets(shape.hidden_size)
    buckets_bytes = PRECISION_BYTES[work.precision] * buckets.reduce_bucket_elems
    blocks = result.get("blocks_per_rank", count.num_layers)
    gathers = comm.zero3_gathers(result["params_per_rank"])  # as layouts._comm counts the gathered bytes
    calls = dp_calls(c, count, blocks, m, buckets, buckets.param_persistence_threshold, gathers)
    dp = _dp_exposed(c, by_group.get("dp", []), profile, place["dp"][1], t_mb, m, buckets_bytes, calls)
    if by_group.get("edp"):  # an expert-parallel layout's expert gradients, over their own group (moe/parallel.py)
        edp = _dp_exposed(c, by_group["edp"], profile, place["edp"][1], t_mb, m, buckets_bytes, calls)
        dp = {k: dp[k] + edp[k] for k in dp}
    expert_s = _expert_parallel_s(c, count, profile, work, by_group.get("ep", []), place["ep"][1], m)
    hooks = hardware.measured(profile, "zero_overhead_s_per_tensor").get(str(c.stage), 0.0)
    hooks_s = m * len(rank_tensors(count, blocks, c.tp)) * hooks if c.stage and c.pp == 1 else 0.0
    hooks_s = max(hooks_s, -(dp["dp_reduce"] + dp["dp_gather"]))  # a correction never below no traffic at all
    tied_s = sum(_row_s(profile, r, place["pp-tied"][1]) for r in by_group.get("pp-tied", []))
    # ZeRO-3 Muon's gathers run inside the optimizer step, nothing to hide them behind (planner/optimizer.py)
    muon_s = sum(_row_s(profile, r, place["dp"][1]) for r in by_group.get("muon", []))
    trainable = result.get("trainable_per_rank", result["params_per_rank"])  # LoRA: only adapters are stepped
    shard = trainable if c.stage == 0 else -(-trainable // result["dp"])
    shard = result.get("moe", {}).get("optimizer_shard", shard) if c.ep > 1 else shard
    off = _offload_s(c, profile, cluster, work, shard, m, t_mb)
    breakdown = {
        "forward_s": m * t_mb["forward"], "backward_s": m * t_mb["backward"], "recompute_s": m * t_mb["recompute"],
        "tp_comm_s": tp_s, "sp_a2a_s": sp_s, "activation_offload_s": activation_offload_s(profile, result, m),
        "bubble_s": (slots - m) * slot, "p2p_s": p2p_s,
        "dp_reduce_exposed_s": dp["dp_reduce"], "dp_gather_exposed_s": dp["dp_gather"], "tied_embedding_s": tied_s,
        "optimizer_s": off["optimizer"], "offload_pcie_s": off["pcie"], "nvme_s": off["nvme"], "zero_hooks_s": hooks_s,
        **expert_s, **({"muon_gather_s": muon_s} if muon_s else {}),
    }
    ref = result["memory"].get("reference") or {}
    if ref.get("mode") in ("engine", "adapter"):  # one more forward (no backward) of the 2B rows per micro-step
        breakdown["reference_s"] = m * t_mb["forward"]
    breakdown.update(teacher.step_s(result, m, t_mb["forward"], count.total))  # a distillation run's teacher forward
    step = sum(breakdown.values())
    per_stage = []
    if c.pp > 1:  # what each stage computes per step; the rest of the step it waits (bubble, its neighbours)
        for i, t in enumerate(stage_computes(c, count, shape, profile, work, result, stage_blocks)):
            busy = m * sum(t.values())
            per_stage.append({"stage": i, "compute_s": busy, "idle_s": max(0.0, step - busy), "busy": busy / step})
    tokens = work.global_batch * work.seq_len  # a preference run's: both sequences of each pair (_sequence_work)
    peak = hardware.peak_flops(profile, work.precision)  # MFU on active parameters (model_flops_per_step)
    # what the precomputed pass would cost before training (shown beside every mode; in the step for none)
    extra = {"reference_pass_s": reference.pass_s(work, world, t_mb["forward"])} if ref.get("mode") else {}
    if (result["memory"].get("teacher") or {}).get("modes"):  # the precomputed store's pass, beside every mode
        extra["teacher_pass_s"] = teacher.pass_s(work, world, profile)
    return {**extra, "step_time_s": step, "tokens_per_s": tokens / step, "tokens_per_s_per_gpu": tokens / step / world,
            "mfu": model_flops_per_step(count, shape, work.seq_len, tokens) / (step * world * peak),
            "breakdown": breakdown, "dp_comm_total_s": dp["dp_total"], "profile": profile["name"],
            "per_stage": per_stage, "interleave": interleave}


def _rows_by_group(rows: list[dict]) -> dict[str, list[dict]]:
    by_group: dict[str, list[dict]] = {}
    for row in rows:
        by_group.setdefault(row["group"], []).append(row)
    return by_group


def _p2p_s(pp: int, profile: dict, rows: list[dict], inter: bool, m: int) -> float:
    """The pipeline's blocking sends: one activation forward and one gradient back in each of the m + pp - 1 slots
    of the critical path."""
    send = next((r for r in rows if r["collective"] == "send"), None)
    if not send:
        return 0.0
    per_message = dict(send, logged_bytes=send["logged_bytes"] / (m * _neighbours(pp)))
    return 2 * (m + pp - 1) * _row_s(profile, per_message, inter)


def activation_offload_s(profile: dict, result: dict, m: int) -> float:
    """Checkpointed block inputs to CPU RAM in forward and back in backward, over PCIe, per micro-batch; counted
    exposed (the copies wait on the block they feed)."""
    return 2 * m * result.get("activation_offload_bytes_per_rank", 0) / (profile["pcie_gbps"] * 1e9)


def _sequence_work(c, work: Workload) -> Workload:
    """The workload one rank computes: under Ulysses seq_len x micro_batch / sp tokens (its matmuls), attention over
    the whole sequence for heads / sp (block_flops_per_token keeps seq_len whole: the same FLOPs per rank); the
    long-context rung forces checkpointing. A preference objective's pairs are two sequences each."""
    rows = work.rows_per_item
    return work.but(micro_batch=work.micro_batch * rows / c.sp, activation_checkpointing=c.checkpointing(work),
                    global_batch=work.global_batch * rows if work.global_batch else work.global_batch)


def tiled_mlp_recompute_s(shape: ModelShape, profile: dict, work: Workload, tp: int, blocks: int) -> float:
    """The MLP matmuls once more per block (2 FLOPs per weight per token): 3 h I weights (GLU), 2 h I (gpt2)."""
    weights = (2 if shape.model_type == "gpt2" else 3) * shape.hidden_size * shape.intermediate_size / tp
    tokens = work.seq_len * work.micro_batch
    return 2 * weights * tokens * blocks / hardware.achieved_flops(profile, work.precision)


def _expert_parallel_s(c, count, profile: dict, work: Workload, rows: list[dict], inter: bool, m: int) -> dict:
    """An expert-parallel layout's all-to-all seconds per step (on the critical path: the experts wait for their
    tokens) and the routed experts' extra compute on the busiest rank, both scaled by the imbalance
    (moe/parallel.py)."""
    if c.ep <= 1:
        return {"all_to_all_s": 0.0, "expert_imbalance_s": 0.0}
    from harness.planner.moe import DEFAULT_IMBALANCE, all_to_all_calls, routed_flops_per_token

    imbalance = work.expert_imbalance or DEFAULT_IMBALANCE
    calls = all_to_all_calls(count, micro_batches=m, activation_checkpointing=work.activation_checkpointing)
    a2a = sum(_row_s(profile, r, inter, calls) for r in rows)
    tokens = work.seq_len * work.micro_batch * m
    passes = 4 if work.activation_checkpointing else 3  # forward, backward (2x), recomputed forward
    routed = passes * tokens * routed_flops_per_token(count) / hardware.achieved_flops(profile, work.precision)
    return {"all_to_all_s": a2a * imbalance, "expert_imbalance_s": routed * (imbalance - 1)}


def _neighbours(pp: int) -> int:
    """Neighbours of the stage the comm rows describe (a middle stage when there is one)."""
    return 2 if pp > 2 else 1
