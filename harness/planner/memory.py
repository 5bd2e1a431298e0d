"""Per-rank memory: model states term by term, activations, and where each lives (gpu / cpu / nvme).

Two conventions for model states:
- "seed": the rule of thumb (ZeRO paper), mixed-precision Adam = 16 bytes/param (2 weights + 2 grads + 4 fp32 master
  + 8 Adam moments; fp32 training: 4 + 4 + 8), sharded by ZeRO stage: 7B -> 112 GB; ZeRO-3 on 8 -> 14 GB.
- "deepspeed": what DeepSpeed 0.19.8 allocates, read from its source and checked against live engines
  (docs/deepspeed-facts.md): the fp32 master copy exists in every ZeRO stage even for fp32 training,
  gradients are freed after the step in stages 0-2 but ZeRO-3 keeps a flat 16-bit gradient partition and
  a reduce bucket of `reduce_bucket_size` elements for the whole run, ZeRO-3 keeps tensors under
  `param_persistence_threshold` whole on every rank, offload keeps pinned fp32 gradient buffers on the CPU.

phase="after_step" keeps what is alive between optimizer steps (what a live tensor count after a step
sees); phase="peak" adds what exists only during backward/step (gradients, fp32 gradient partitions,
buckets, gathered ZeRO-3 parameters), each term at its own peak. Not all of them are alive at once:
phase="backward" is what backward holds (with the activations), phase="step" what the optimizer step holds
(activations freed: the 16-bit flat gradient partition ZeRO copies and upcasts to its fp32 gradient partition).
`training_peak` is the larger of the two: the per-rank peak the planner fits and the profiler compares.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.config.defaults import PRECISION_BYTES, TILE_TOKENS, ZERO0_ALLREDUCE_BUCKET_ELEMS, model_sized_buckets
from harness.config.run_model import ADAM_STATES, Zero, ZeroBuckets
from harness.planner import activations as la
from harness.planner import vision as vl
from harness.planner.inputs import LongContext, Workload
from harness.planner.shape import ModelShape

FP32_BYTES = 4
DEVICES = ("gpu", "cpu", "nvme")
TERMS = ("params", "grads", "fp32_master", "optimizer_moments", "fp32_grads", "reduce_buckets",
         "gathered_params", "offload_buffers")
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
PHASES = ("after_step", "peak", "backward", "step")
# When an entry's bytes are alive (the 4th field of the entries below): between steps too, while backward
# produces gradients, inside the optimizer step, or from backward through the step.
ALWAYS, BACKWARD, STEP, BOTH = "always", "backward", "step", "both"
_ALIVE = {"after_step": {ALWAYS}, "peak": {ALWAYS, BACKWARD, STEP, BOTH}, "backward": {ALWAYS, BACKWARD, BOTH},
          "step": {ALWAYS, STEP, BOTH}}


def harness_buckets(hidden_size: int) -> ZeroBuckets:
    """What the harness's recipes resolve to (harness/config/resolve.py, like the HF integration's "auto"): buckets
    sized from the model, so a small model does not carry a 1 GB ZeRO-3 bucket (DeepSpeed issues #3734,
    #6936); overlap_comm on for every stage (two reduce buffers in stages 1-2)."""
    sized = model_sized_buckets(hidden_size)
    return ZeroBuckets(reduce_bucket_elems=sized["reduce_bucket_size"],
                       prefetch_bucket_elems=sized["stage3_prefetch_bucket_size"],
                       param_persistence_threshold=sized["stage3_param_persistence_threshold"], overlap_comm=True)


def _check(precision: str, stage: int, zero_shards: int, offload_optimizer: str, offload_param: str) -> None:
    if precision not in PRECISION_BYTES:
        raise ValueError(f"precision {precision!r}: expected one of {', '.join(PRECISION_BYTES)}")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"zero stage {stage}: expected 0, 1, 2 or 3")
    if zero_shards < 1:
        raise ValueError(f"zero_shards {zero_shards}: expected >= 1")
    for name, value in (("offload_optimizer", offload_optimizer), ("offload_param", offload_param)):
        if value not in OFFLOAD_DEVICES:
            raise ValueError(f"{name} {value!r}: expected one of {', '.join(OFFLOAD_DEVICES)}")
    if offload_param != "none" and stage != 3:
        raise ValueError(f"offload_param={offload_param} needs ZeRO stage 3 (got stage {stage})")


def _seed_entries(p: int, stage: int, zero_shards: int, lp: int, opt_dev: str, param_dev: str, t: int,
                  held: "Holding") -> list:
    def shard(nbytes: int, from_stage: int) -> int:
        return -(-nbytes // zero_shards) if stage >= from_stage else nbytes

    master = 0 if lp == held.master_bytes == FP32_BYTES else held.master_bytes * t
    # Muon's share keeps one state, the rest the optimizer's own count
    states = held.state_bytes * (held.optimizer_states * (t - held.muon_params) + held.muon_params)
    return [("params", param_dev, shard(lp * p, 3), ALWAYS), ("grads", "gpu", shard(lp * t, 2), ALWAYS),
            ("fp32_master", opt_dev, shard(master, 1), ALWAYS),
            ("optimizer_moments", opt_dev, shard(states, 1), ALWAYS)]


def _stage0_entries(p: int, lp: int, t: int, states: int) -> list:
    master = 0 if lp == FP32_BYTES else FP32_BYTES * t
    return [("params", "gpu", lp * p, ALWAYS), ("grads", "gpu", lp * t, BOTH),
            ("fp32_master", "gpu", master, ALWAYS),
            ("optimizer_moments", "gpu", states * FP32_BYTES * t, ALWAYS),
            ("fp32_grads", "gpu", master, BOTH),  # the 16-bit optimizer wrapper steps on fp32 grads
            ("reduce_buckets", "gpu", lp * min(t, ZERO0_ALLREDUCE_BUCKET_ELEMS), BACKWARD)]


@dataclass(frozen=True)
class _Rank:
    """What one rank holds, as model_state_bytes' arguments resolved: p every parameter its ZeRO group shards, t the
    trainable ones; lp bytes per 16-bit (or fp32) element; the largest module and tensor (ZeRO-3 gathers, offload
    staging), the largest trainable tensor and module (gradient staging), ZeRO-3's persistent parameters."""

    p: int
    t: int
    zero_shards: int
    lp: int
    b: ZeroBuckets
    largest_layer: int
    largest_tensor: int
    grad_tensor: int
    grad_layer: int
    persistent: int
    grad_accum: int
    accum_elems: int | None
    states: int  # optimizer tensors per trainable element (Holding.optimizer_states)
    master_bytes: int = FP32_BYTES  # per element of the master copy and ZeRO's gradient partition it steps on
    state_bytes: int = FP32_BYTES  # per element of each optimizer state
    muon: int = 0  # of t, the elements Muon steps (one momentum buffer each, in the gradients' dtype)
    muon_whole: int | None = None  # ZeRO-1/2: Muon elements held whole per rank (Holding.muon_whole)
    muon_gathers: int = 0  # ZeRO-3: bytes of Muon's cached gather buffers (Holding.muon_gathers)


def _states_bytes(r: "_Rank", shard: int, stage12: bool) -> int:
    """This rank's optimizer states: the AdamW side's `states` tensors of state_bytes on its shard of t - muon;
    Muon's momentum in the gradients' dtype (lp): under ZeRO-1/2 for every whole Muon matrix that overlaps the
    rank's partition (Newton-Schulz needs the matrix; at most the shard plus one largest matrix), and a second
    buffer of that size DeepSpeed keeps while it folds gradients in (stage_1_and_2._muon_pending_momentum);
    under ZeRO-3 the rank's flat partition, again in the gradients' dtype (measured on live engines)."""
    if not r.muon:
        return r.states * r.state_bytes * shard
    adam_shard, muon_shard = -(-(r.t - r.muon) // r.zero_shards), -(-r.muon // r.zero_shards)
    adam = r.states * r.state_bytes * adam_shard
    return adam + r.lp * (_muon_whole(r) if stage12 else muon_shard)


def _muon_whole(r: "_Rank") -> int:
    """Elements of the whole Muon matrices overlapping a ZeRO-1/2 partition (the largest over the ranks): from the
    layout when known (Holding.muon_whole), else at most the shard plus one largest tensor."""
    if r.muon_whole is not None:
        return r.muon_whole
    return min(r.muon, -(-r.muon // r.zero_shards) + (r.grad_tensor if r.zero_shards > 1 else 0))


def _muon_whole_bytes(r: "_Rank") -> int:
    """ZeRO-1/2 Muon: one 16-bit tensor the size of the whole Muon matrices overlapping the partition: the staging
    momentum, and the updates muon_update returns at the end of backward (stage_1_and_2.get_flat_partition), kept
    as averaged_gradients until step() flattens them (measured: tests/test_optimizers.py)."""
    return r.lp * _muon_whole(r) if r.muon else 0


def _stage12_entries(r: _Rank, stage: int, offload: bool) -> list:
    """Stage 1/2: the 16-bit parameters replicated; the trainable ones' gradients, partitions and optimizer state."""
    frozen, p, zero_shards, lp, b, largest_tensor = r.p - r.t, r.t, r.zero_shards, r.lp, r.b, r.grad_tensor
    shard = -(-p // zero_shards)
    opt_dev = "cpu" if offload else "gpu"  # stage 1/2 treat nvme as cpu (deepspeed-facts.md)
    buckets = 2 if b.overlap_comm else 1
    grads = lp * p if stage == 1 else (0 if offload else lp * shard) + lp * largest_tensor
    out = [("params", "gpu", lp * (p + frozen), ALWAYS), ("grads", "gpu", grads, BOTH),
           ("fp32_master", opt_dev, r.master_bytes * shard, ALWAYS),
           ("optimizer_moments", opt_dev, _states_bytes(r, shard, True), ALWAYS),
           ("optimizer_moments", "gpu", _muon_whole_bytes(r), ALWAYS), ("grads", "gpu", _muon_whole_bytes(r), STEP),
           ("reduce_buckets", "gpu", lp * b.reduce_bucket_elems * buckets, BACKWARD)]
    # the gradient partition the optimizer steps on: pinned and kept with offload; else made in step() by
    # .to(master dtype), a new tensor only when that differs from the 16-bit gradients (bf16 master: none)
    if offload or r.master_bytes != lp or lp == FP32_BYTES:
        out.append(("fp32_grads", opt_dev, r.master_bytes * shard, ALWAYS if offload else STEP))
    if not offload and lp != FP32_BYTES:  # step(): flatten(averaged_gradients) makes a 16-bit flat copy of the
        # partition, then .to(fp32) the fp32 one, while the gradients are still held (freed after)
        out.append(("grads", "gpu", lp * shard, STEP))
    if offload:  # temp_grad_buffer_for_{gpu,cpu}_offload (largest parameter) and the pinned 16-bit copy of
        # the partition that CPU Adam writes before it is copied back (param_buffer_of_bit16_for_cpu_offload)
        out += [("offload_buffers", "gpu", lp * largest_tensor, ALWAYS),
                ("offload_buffers", "cpu", lp * largest_tensor + lp * shard, ALWAYS)]
    if offload and r.grad_accum > 1:
        # accumulated_grads_in_cpu: a pinned 16-bit buffer of the WHOLE tensor for every parameter that overlaps
        # this rank's partition, kept between steps. A tensor straddling a partition boundary is held whole by
        # both neighbours, so without the layout: at most one largest tensor over the shard.
        elems = r.accum_elems if r.accum_elems is not None else shard + (largest_tensor if zero_shards > 1 else 0)
        out.append(("grads", "cpu", lp * elems, ALWAYS))
    return out


def zero3_gathered_elems(gathered: int, largest_layer: int, b: ZeroBuckets) -> int:
    """Elements ZeRO-3 holds gathered at once, at the turn from forward to backward.

    DeepSpeed 0.19.8 (partitioned_param_coordinator.__params_to_release) does not release a module's
    gathered parameters after its forward when the module is used again within stage3_max_reuse_distance
    elements of the trace. In the trace the last blocks' forward is followed by their backward, so a block whose
    later modules hold fewer than max_reuse_distance / 2 elements (forward, then again backward) stays gathered
    until its backward: the model's tail of max_reuse_distance / 2 elements (all of a model under 0.5B
    parameters with the default 1e9), plus the module being gathered and the prefetch bucket beyond it.
    Measured: this is also why a small model is all-gathered once per micro-step, not twice
    (rank.gathers_per_micro_step)."""
    retained = min(gathered, b.max_reuse_distance_elems // 2)
    return min(gathered, retained + largest_layer + b.prefetch_bucket_elems)


def _stage3_entries(r: _Rank, opt_dev: str, param_dev: str) -> list:
    """Stage 3: every parameter partitioned and gathered (frozen ones too); the trainable ones' gradient partitions,
    fp32 master and optimizer state."""
    p, t, zero_shards, lp, b, persistent = r.p, r.t, r.zero_shards, r.lp, r.b, r.persistent
    largest_layer, largest_tensor, grad_layer = r.largest_layer, r.largest_tensor, r.grad_layer
    shard, p_shard = -(-t // zero_shards), -(-p // zero_shards)
    grad_dev = "gpu" if opt_dev == "none" else "cpu"  # the flat grad partition follows the optimizer
    opt_dev = "gpu" if opt_dev == "none" else opt_dev
    sub_group = min(shard, b.sub_group_elems)
    out = [("params", "gpu" if param_dev == "none" else param_dev, lp * p_shard, ALWAYS),
           ("params", "gpu", lp * persistent, ALWAYS),  # whole copies of small tensors on every rank
           ("grads", grad_dev, lp * shard, ALWAYS),  # grad_partitions_flat_buffer
           ("grads", "gpu", lp * grad_layer, BACKWARD),  # one module's full grads before reduce-scatter
           ("fp32_master", opt_dev, r.master_bytes * shard, ALWAYS),
           ("optimizer_moments", opt_dev, _states_bytes(r, shard, False), ALWAYS),
           ("reduce_buckets", "gpu", lp * b.reduce_bucket_elems + r.muon_gathers, ALWAYS),
           ("gathered_params", "gpu", lp * zero3_gathered_elems(p - persistent, largest_layer, b), BACKWARD)]
    if opt_dev == "gpu":  # _prepare_fp32_grad_for_sub_group: flatten (16-bit copy) then .to(fp32), per sub-group
        if r.master_bytes != lp or lp == FP32_BYTES:  # .to(master dtype) copies unless it is a no-op (bf16 master)
            out.append(("fp32_grads", "gpu", r.master_bytes * sub_group, STEP))
        if lp != FP32_BYTES:
            out.append(("grads", "gpu", lp * sub_group, STEP))
    else:  # subgroup_gradient_buffer, pinned; swapped with the optimizer states on nvme
        out.append(("fp32_grads", opt_dev, r.master_bytes * shard, ALWAYS))
    if opt_dev == "nvme":
        out.append(("offload_buffers", "cpu", b.optimizer_swap_buffer_count * FP32_BYTES * sub_group, ALWAYS))
    if param_dev == "nvme":
        elems = max(b.param_swap_buffer_elems, largest_tensor)
        out.append(("offload_buffers", "cpu", b.param_swap_buffer_count * lp * elems, ALWAYS))
    return out


@dataclass(frozen=True)
class Holding:
    """What one rank holds, in elements (model_state_bytes' counts).

    params: parameters this rank's ZeRO group shards (after tensor/pipeline splits).
    largest_layer: the largest module's own parameters (ZeRO-3 gathers one at a time).
    largest_tensor: the largest single tensor (offload staging buffers); None = largest_layer.
    persistent: elements in tensors at or under ZeRO-3's param_persistence_threshold.
    accum_elems: elements of the tensors overlapping this rank's ZeRO-1/2 partition, when the layout is known
    (a live engine); else bounded by the shard plus one largest tensor.
    trainable: of params, those with gradients and optimizer state (LoRA adapters); None = all. A frozen
    parameter costs its 16-bit copy only (sharded under ZeRO-3, which still gathers it per layer).
    largest_trainable_tensor / _layer: the same for the gradient staging buffers (None: the largest ones).
    optimizer_states: tensors the optimizer keeps per trainable element (config/run_model.optimizer_states:
    Adam's two moments by default; plain SGD none).
    master_bytes / state_bytes: bytes per element of the master copy (and the gradient partition it steps on) and
    of each optimizer state: 4, or 2 with bf16 master weights / states (config/run_model.OptimizerDtypes).
    muon_params: of the trainable elements, those DeepSpeed's Muon steps (one momentum each; the rest AdamW's two).
    muon_whole: ZeRO-1/2, the Muon elements a rank holds whole (muon_partition_elems); None: bounded.
    muon_gathers: ZeRO-3, bytes of the gather buffers Muon keeps (optimizer.muon_gather_cache_bytes).
    """

    params: int
    largest_layer: int = 0
    largest_tensor: int | None = None
    persistent: int = 0
    accum_elems: int | None = None
    trainable: int | None = None
    largest_trainable_tensor: int | None = None
    largest_trainable_layer: int | None = None
    optimizer_states: int = ADAM_STATES
    master_bytes: int = FP32_BYTES
    state_bytes: int = FP32_BYTES
    muon_params: int = 0
    muon_whole: int | None = None
    muon_gathers: int = 0


def model_state_bytes(held: Holding, zero: Zero, *, zero_shards: int, precision: str, convention: str = "deepspeed",
                      phase: str = "peak", grad_accum: int = 1) -> dict[str, dict[str, int]]:
    """Bytes per rank: {term: {"gpu": n, "cpu": n, "nvme": n}} for every term in TERMS.

    held: what the rank holds (Holding); zero: the ZeRO stage, offloads and buffer sizes.
    grad_accum: gradient accumulation steps (ZeRO-1/2 with offload keep CPU accumulation buffers when > 1).
    """
    num_params, stage = held.params, zero.stage
    offload_optimizer, offload_param = zero.offload_optimizer, zero.offload_param
    _check(precision, stage, zero_shards, offload_optimizer, offload_param)
    if convention not in ("seed", "deepspeed") or phase not in PHASES:
        raise ValueError(f"convention {convention!r} / phase {phase!r}: expected seed|deepspeed, {'|'.join(PHASES)}")
    lp = PRECISION_BYTES[precision]
    b = zero.buckets
    if b.overlap_comm is None:
        b = ZeroBuckets(**{**b.__dict__, "overlap_comm": stage == 3})
    largest_layer_params, largest_tensor_params = held.largest_layer, held.largest_tensor
    largest_tensor = largest_layer_params if largest_tensor_params is None else largest_tensor_params
    trainable = num_params if held.trainable is None else held.trainable
    if trainable > num_params:
        raise ValueError(f"trainable_params {trainable} > num_params {num_params}")
    grad_tensor = largest_tensor if held.largest_trainable_tensor is None else held.largest_trainable_tensor
    if convention == "seed":
        opt = "gpu" if offload_optimizer == "none" else offload_optimizer
        par = "gpu" if offload_param == "none" else offload_param
        entries = _seed_entries(num_params, stage, zero_shards, lp, opt, par, trainable, held)
    elif stage == 0:
        entries = _stage0_entries(num_params, lp, trainable, held.optimizer_states)
    else:
        grad_layer = largest_layer_params if held.largest_trainable_layer is None else held.largest_trainable_layer
        r = _Rank(num_params, trainable, zero_shards, lp, b, largest_layer_params, largest_tensor, grad_tensor,
                  grad_layer, held.persistent, grad_accum, held.accum_elems, held.optimizer_states, held.master_bytes,
                  held.state_bytes, held.muon_params, held.muon_whole, held.muon_gathers)
        entries = (_stage12_entries(r, stage, offload_optimizer != "none") if stage in (1, 2)
                   else _stage3_entries(r, offload_optimizer, offload_param))
    out = {term: dict.fromkeys(DEVICES, 0) for term in TERMS}
    for term, device, nbytes, alive in entries:
        if alive in _ALIVE[phase]:
            out[term][device] += int(nbytes)
    return out


def training_peak(model_states, activations: int, device: str = "gpu") -> int:
    """Peak bytes on `device` per rank in training: backward's model states with the activations, or the optimizer
    step's, whichever is larger. model_states(phase) -> {term: {device: bytes}} (model_state_bytes with the
    run's arguments)."""
    return max(by_device(model_states("backward"))[device] + activations, by_device(model_states("step"))[device])


def checkpoint_bytes(num_params: int, precision: str, trainable_params: int | None = None,
                     optimizer_states: int = ADAM_STATES) -> int:
    """Bytes of one DeepSpeed checkpoint summed over ranks: weights in the training precision (model states) plus
    the fp32 master copy and the optimizer's states (Adam's two moments by default; ZeRO splits them across ranks,
    the sum stays). With LoRA (trainable_params) the frozen weights are not saved (exclude_frozen_parameters)."""
    saved = num_params if trainable_params is None else trainable_params
    return saved * (PRECISION_BYTES[precision] + FP32_BYTES * (1 + optimizer_states))


def by_device(terms: dict[str, dict[str, int]]) -> dict[str, int]:
    """Sum a {term: {device: bytes}} table per device."""
    return {d: sum(t[d] for t in terms.values()) for d in DEVICES}


def _layer_token_elems(shape: ModelShape, tp: int) -> float:
    """Elements saved for backward per token in one block (sdpa/flash attention: no seq x seq scores).

    Replicated across tensor-parallel ranks: the norm inputs and outputs that feed the projections.
    Split by tp: q, k, v, attention output and the MLP's intermediate tensors.
    """
    h, inter = shape.hidden_size, shape.intermediate_size
    kv_dim = shape.num_key_value_heads * shape.head_dim
    if shape.model_type == "gpt2":  # ln_1/c_attn in, ln_2/c_fc in | qkv, attn out, fc out, gelu out
        return 4 * h + (4 * h + 2 * inter) / tp
    # input/post-attention norm in+out | q, k, v, attention out | gate, up, act(gate), act*up
    return 4 * h + (2 * h + 2 * kv_dim + 4 * inter) / tp


def activation_bytes(shape: ModelShape, work: Workload, *, tp: int = 1, long_context: LongContext = LongContext(),
                     num_layers: int | None = None, micro_batches_in_flight: int = 1,
                     with_logits: bool = True) -> dict[str, int]:
    """Activation bytes per rank for `num_layers` blocks (default all) and the loss, training `work` (its sequence,
    micro-batch, precision, checkpointing, attention and tile size).

    With checkpointing each block keeps only its input and one block is recomputed at a time.
    `micro_batches_in_flight` is what a pipeline stage holds (1F1B: min(stages - stage_id, m)).
    Logits: 16-bit output plus the fp32 upcast and log-softmax that HF's loss keeps; other objectives by the
    registry's planner field (objective_logits).
    Long context (planner/activations.py, with the sources): sp divides the tokens per rank (Ulysses); tiled_mlp
    drops the MLP intermediates for one tile of tile_tokens; tiled_loss holds one tile of logits; the attention adds
    its materialised mask (sdpa, eager) and eager's scores; offload (with checkpointing) moves the block inputs to
    CPU RAM ("cpu_offload", per rank).
    """
    seq_len, attention, tile_tokens = work.seq_len, work.attention, work.tile_tokens
    micro_batch = work.micro_batch * work.rows_per_item  # a preference pair: its chosen and rejected sequences
    activation_checkpointing, lp = work.activation_checkpointing, PRECISION_BYTES[work.precision]
    sp, tiled_mlp, tiled_loss = long_context.sp, long_context.tiled_mlp, long_context.tiled_loss
    offload = long_context.offload
    tokens = la.tokens_per_rank(seq_len, micro_batch, sp)
    layers = shape.num_hidden_layers if num_layers is None else num_layers
    elems = _layer_token_elems(shape, tp) + la.sp_token_elems(shape, tp, sp)
    elems -= la.mlp_token_elems(shape, tp) if tiled_mlp else 0
    per_layer = int(tokens * lp * elems) + la.scores_bytes(shape, attention, seq_len, sp, micro_batch, lp, tp)
    if shape.dropout_masks:  # bool masks after attention and MLP (GPT-2's resid_pdrop)
        per_layer += 2 * tokens * shape.hidden_size
    block_input = tokens * lp * shape.hidden_size
    if activation_checkpointing:
        stored, recompute = layers * block_input * micro_batches_in_flight, per_layer
    else:
        stored, recompute = layers * per_layer * micro_batches_in_flight, 0
    offloaded = 0
    if offload and activation_checkpointing:  # the block inputs live in CPU RAM; two on the device
        offloaded, stored = stored, min(stored, 2 * block_input)
    tile = la.mlp_tile_bytes(shape, tokens, lp, tp, tile_tokens) if tiled_mlp else 0
    logits = 0
    if with_logits:
        logits = objective_logits(work, tokens, shape, lp, tiled_loss)
    mask = la.mask_bytes(attention, seq_len, sp, micro_batch, lp)
    total = stored + recompute + tile + logits + mask + 2 * block_input  # + embedding output, final norm input
    vision = {"saved": 0, "transient": 0}
    if work.vision is not None:  # kept through the language model's forward; one call's peak comes before it
        vision = vl.activation_bytes(work.vision, work.micro_batch, lp, activation_checkpointing)
        total = vision["saved"] + max(total, vision["transient"])
    return {"per_layer": per_layer, "layers": stored, "recompute": recompute, "logits": logits,
            "mlp_tile": tile, "mask": mask, "cpu_offload": offloaded, "tokens_per_rank": tokens,
            "vision_saved": vision["saved"], "vision_transient": vision["transient"], "total": total}


def objective_logits(work: Workload, tokens: int, shape: ModelShape, lp: int, tiled_loss: bool) -> int:
    """The logits term of the objective's loss (planner/activations.py): the LM's (tiled or whole), a preference
    pair's (both rows, one up-cast at a time), an RL step's (the completion positions only), a distillation loss's
    (the student's logits and their gradient, one fp32 chunk of tokens)."""
    if work.terms == "pairs":
        return la.pair_logits_bytes(tokens, work.seq_len, shape, lp)
    if work.terms == "rollouts":
        return la.rollout_logits_bytes(tokens * (work.completion_len or work.seq_len) // work.seq_len, shape, lp)
    if work.terms == "distill":
        return la.distill_logits_bytes(tokens, shape, lp, work.teacher.chunk_tokens, work.teacher.beta)
    return la.logits_bytes(tokens, shape, lp, tiled_loss, work.tile_tokens)
