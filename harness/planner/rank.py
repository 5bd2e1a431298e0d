"""One rank of a run as the planner predicts it, with the facts only its live engine knows (LiveFacts): model-state
bytes per phase, activations, logged comm bytes per step. The report sets these beside what the hooks measure.

A plain (or ZeRO, TP, SP, AutoEP) run takes the parameters this rank's ZeRO group holds from the live engine
(ds_numel after any tensor-parallel split, ZeRO-3's persistent tensors, params_in_partition), so a gap between
predicted and measured is a gap in the planner's model, not in its inputs. A pipeline rank's parameters come
from the model's shape through the planner's own copy of DeepSpeed's layer partitioning (planner/pipeline.py),
so the comparison also tests the stage split; only the rank's stage, the engine's partition, its largest tensor
and its optimizer class are read from the run.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from harness.config.run_model import Completions, RunModel, Sequence, Zero
from harness.planner import comm, memory, moe, pipeline, reference, sequence, teacher
from harness.planner.inputs import LongContext, Workload
from harness.planner.shape import ModelShape
from harness.planner.optimizer import comm as muon_comm
from harness.planner.optimizer import gathers, holding
from harness.planner.params import count_params, model_shape, with_lora


@dataclass(frozen=True)
class LiveFacts:
    """Per-rank parameter facts read off the live engine (profiling/live.py)."""

    total: int  # parameters this rank's ZeRO group shards (ds_numel: after any tensor-parallel split)
    largest_layer: int  # the largest module's own parameters
    largest_tensor: int
    persistent: int = 0  # ZeRO-3 tensors DeepSpeed keeps whole on every rank (ds_persist)
    partition_whole: int | None = None  # ZeRO-1/2: whole tensors overlapping this rank's partition
    muon: int = 0  # parameters DeepSpeed's Muon steps (use_muon)
    muon_whole: int | None = None  # ZeRO-1/2: of partition_whole, the Muon matrices
    muon_groups: tuple[tuple[int, ...], ...] = ()  # ZeRO-3: the Muon sub-groups' matrices (elements), in order
    trainable: int | None = None  # LoRA: the adapters (None: every parameter trains)
    largest_trainable_tensor: int | None = None
    largest_trainable_layer: int | None = None
    experts: int = 0  # AutoEP expert parameters on this rank
    pipe_stage: int = 0  # a pipeline rank's own stage
    parts: tuple[int, ...] = ()  # the PipelineModule's layer split
    bf16_optimizer: bool = False  # DeepSpeed's BF16_Optimizer (pipelines in bf16) all-reduces the tied embedding


def attention_kind(seq: Sequence, sp: int) -> str:
    """The kernel whose mask and scores the activations count (planner/activations.py) for train.attention."""
    attention = str(seq.attention or "auto").lower()  # auto on CPU: sdpa, document_sdpa under SP
    kind = next((k for k in ("flash", "flex", "eager") if k in attention), "sdpa")
    if kind == "sdpa" and sp == 1 and seq.packing == "concat":
        # concat rows carry no position ids: transformers' sdpa runs is_causal without a mask (torch's flash
        # kernel), so neither the s^2 bool mask nor its float copy exists: the activation model's "flash" terms
        # (measured, bench/long_context.py: the s^2 terms made the planner's longest 6,211 where 8,192 fit)
        kind = "flash"
    return kind


def long_context(seq: Sequence, sp: int) -> LongContext:
    """A run's long-context handling as memory.activation_bytes takes it (Ulysses sp, tiling, activation offload)."""
    return LongContext(sp, seq.tiled_mlp, seq.tiled_loss, seq.activation_offload)


def workload(run: RunModel) -> Workload:
    """The planner's workload of this run: its batch, sequence handling and precision."""
    seq, b, pref = run.sequence, run.batch, run.preference
    goal = {"objective": pref.objective, "reference_mode": pref.reference_mode} if pref else {}
    seq_len = seq.seq_len
    if run.completions is not None:
        seq_len, goal = completions_goal(run.completions, run.model, dict(run.model_config), seq_len)
    return Workload(seq_len, b.micro_batch, run.precision, seq.activation_checkpointing, b.grad_accum,
                    attention=attention_kind(seq, run.degrees.sp), packing=seq.packing,
                    global_batch=b.global_batch, tile_tokens=seq.tile_tokens, optimizer_states=run.optimizer_states,
                    optimizer_dtypes=run.optimizer_dtypes,
                    vision=run.vision, **goal)


def completions_goal(done: Completions, model: str, model_cfg: dict, seq_len: int) -> tuple[int, dict]:
    """(seq_len, Workload fields) of a completions objective: grpo's rows are the rl block's prompt + completion,
    with a reference when beta > 0; a distillation run's are its records' (seq_len), with its teacher (left out
    when its config cannot be read here)."""
    if done.prompt_len:
        return done.prompt_len + done.completion_len, {
            "objective": done.objective, "reference_mode": done.reference_mode, "beta": done.beta,
            "prompt_len": done.prompt_len, "completion_len": done.completion_len}
    t = teacher.of_run(done, model, model_cfg)
    return seq_len, ({"objective": done.objective, "teacher": t} if t else {})


def gathers_per_micro_step(stage: int, gathered_params: int, max_live: int) -> int:
    """ZeRO-3 re-gathers parameters in backward only when it had to release them after forward: when the
    gathered parameters exceed stage3_max_live_parameters (measured: a small model gathers once)."""
    return comm.zero3_gathers(gathered_params, max_live) if stage == 3 else 2


def shape_of(run: RunModel) -> dict | None:
    try:
        return model_shape(dict(run.model_config))
    except Exception:  # an architecture the planner cannot size: predictions without activations
        return None


def _states(run: RunModel, live: LiveFacts):
    """states(stage, phase) -> model_state_bytes of this rank with the live facts, at any ZeRO stage."""
    z, ep = run.zero, run.degrees.ep
    common = dict(zero_shards=run.degrees.zero_shards, precision=run.precision, grad_accum=run.batch.grad_accum)
    dtypes = run.optimizer_dtypes
    widths = holding(dtypes, live.total, None)
    if dtypes.muon and live.muon:  # this rank's own Muon matrices, read off the engine
        widths.update(muon_params=live.muon, muon_whole=live.muon_whole)

    def states(stage: int, phase: str) -> dict:
        zero = Zero(stage, z.offload_optimizer, z.offload_param if stage == 3 else "none", z.buckets)
        held = memory.Holding(live.total, live.largest_layer, live.largest_tensor,
                              persistent=live.persistent if stage == 3 else 0, accum_elems=live.partition_whole,
                              trainable=live.trainable, largest_trainable_tensor=live.largest_trainable_tensor,
                              largest_trainable_layer=live.largest_trainable_layer,
                              optimizer_states=run.optimizer_states, **widths,
                              **gathers(dtypes, stage, live.muon_groups, run.degrees.zero_shards, z.buckets,
                                        run.precision))
        # AutoEP: this rank's experts shard over zero_shards / ep ranks (planner/moe/parallel.py)
        if ep > 1 and live.experts:
            return moe.model_state_bytes(SimpleNamespace(total=live.total - live.experts + live.experts * ep,
                                                         routed_experts=live.experts * ep), held, zero, ep=ep,
                                         phase=phase, **common)
        return memory.model_state_bytes(held, zero, phase=phase, **common)

    return states


def rank_prediction(run: RunModel, live: LiveFacts) -> dict:
    """Predicted model states (after a step and at peak), activations and logged comm bytes per step of a rank
    outside a pipeline; the sp group's all-to-alls and the tp all-reduces join the comm bytes."""
    z, d = run.zero, run.degrees
    zero_shards, notes = d.zero_shards, []
    states = _states(run, live)
    out: dict = {"params_per_rank": live.total, "dp": zero_shards, "stage": z.stage,
                 "after_step": states(z.stage, "after_step"), "peak": states(z.stage, "peak")}
    out["after_step_by_stage"] = {str(s): sum(memory.by_device(states(s, "after_step")).values()) for s in range(4)}
    gathers = gathers_per_micro_step(z.stage, live.total - live.persistent, z.max_live_params)
    out["comm"] = comm.comm_bytes_per_step(live.total, stage=z.stage, zero_shards=zero_shards,
                                           precision=run.precision, grad_accum=run.batch.grad_accum,
                                           persistent_params=live.persistent, gathers_per_micro_step=gathers,
                                           trainable_params=live.trainable)
    # ZeRO-3 Muon's own gathers in the step, for this rank's Muon sub-groups (planner/optimizer.muon_comm_bytes)
    muon = muon_comm(run.optimizer_dtypes, z.stage, live.muon_groups, zero_shards, z.buckets, run.precision)
    out["comm"] = comm.merged(out["comm"], muon)
    if d.ep > 1 and live.experts:
        edp = max(1, zero_shards // d.ep)
        notes.append(f"expert parallel {d.ep}: {live.experts:,} expert parameters on this rank shard over "
                     f"{edp} expert-data-parallel ranks (model states); the comm bytes count them over dp")
    if z.stage == 3:
        notes.append(f"ZeRO-3 all-gathers parameters {gathers}x per micro-step "
                     f"({live.total - live.persistent:,} gathered params vs "
                     f"stage3_max_live_parameters {z.max_live_params:,})")
    shape = shape_of(run)
    if shape is not None:
        _add_activations(out, run, shape, states)
        ref = _reference_bytes(run, live)
        if ref:  # an engine-mode reference: its frozen weights are alive through the whole step
            out["reference"] = ref
            out["peak_total_bytes"] += ref["gpu"]
        held = _teacher_bytes(run)
        if held:  # an engine-mode teacher: the same, with the teacher's own count
            out["teacher"] = held
            out["peak_total_bytes"] += held["gpu"]
    else:
        notes.append("activations not predicted: the planner cannot size this architecture")
    out["notes"] = notes
    return out


def _add_activations(out: dict, run: RunModel, shape: ModelShape, states) -> None:
    """The activations of the run's sequence handling, and the sp all-to-alls and tp all-reduces they cause."""
    seq, d, prec = run.sequence, run.degrees, run.precision
    micro, accum, ckpt = run.batch.micro_batch, run.batch.grad_accum, seq.activation_checkpointing
    acts = memory.activation_bytes(shape, workload(run), tp=d.tp, long_context=long_context(seq, d.sp))
    out["comm"].update(sequence.a2a_bytes_per_step(
        shape, seq_len=seq.seq_len, micro_batch=micro, micro_batches=accum, sp=d.sp,
        blocks=shape.num_hidden_layers, precision=prec, activation_checkpointing=ckpt))
    out["activations"] = acts
    out["peak_total_bytes"] = memory.training_peak(lambda phase: states(run.zero.stage, phase), acts["total"])
    if d.tp > 1:
        tp_comm = pipeline.tp_allreduce_bytes(shape, tp=d.tp, blocks=shape.num_hidden_layers, seq_len=seq.seq_len,
                                              micro_batch=micro, micro_batches=accum, precision=prec,
                                              activation_checkpointing=ckpt)
        out["comm"]["all_reduce"] = out["comm"].get("all_reduce", 0) + tp_comm


def _reference_bytes(run: RunModel, live: LiveFacts) -> dict | None:
    """This rank's engine-mode reference weights (planner/reference.py; a preference run's, or grpo's with beta > 0):
    the base model (the live parameters less any LoRA adapters), sharded over the ranks like the policy's ZeRO-3
    parameters."""
    extra = run.preference or run.completions
    if getattr(extra, "reference_mode", None) != "engine":
        return None
    z = run.zero
    base = live.total - (live.trainable or 0)
    return reference.engine_bytes(base, stage=z.stage, offload_param=z.offload_param,
                                  zero_shards=run.degrees.zero_shards, precision=run.precision,
                                  persistent=live.persistent if z.stage == 3 else 0)


def _teacher_bytes(run: RunModel) -> dict | None:
    """This rank's engine-mode teacher weights (planner/teacher.py): the teacher's count, sharded like the student's
    ZeRO-3 parameters with the student's persistence threshold, or a whole copy in stages 0-2."""
    done = run.completions
    if done is None or done.teacher_mode != "engine":
        return None
    z = run.zero
    t = teacher.of_run(done, run.model, dict(run.model_config), z.buckets.param_persistence_threshold)
    if t is None:
        return None
    return reference.engine_bytes(t.params, stage=z.stage, offload_param=z.offload_param,
                                  zero_shards=run.degrees.zero_shards, precision=run.precision,
                                  persistent=t.persistent if z.stage == 3 else 0)


def model_count(run: RunModel):
    """The model's count, with the run's LoRA adapters when it has them."""
    count = count_params(dict(run.model_config))
    if run.adapter is not None:
        count = with_lora(count, dict(run.model_config), run.adapter.r, run.adapter.target_modules)
    return count


def counted_tp(run: RunModel, count, parts: tuple[int, ...]) -> int:
    """Which block split DeepSpeed weighed when it partitioned (split after the build: 1, the harness; split
    as built: tp), told by the engine's own partition; 1 when both agree or neither matches (notes say so)."""
    pp, tp, method = run.degrees.pp, run.degrees.tp, run.pipeline_partition
    if tp <= 1 or not parts:
        return 1
    parts = list(parts)
    if pipeline.partition(count, pp, method, tp, 1) != parts and pipeline.partition(count, pp, method, tp, tp) == parts:
        return tp
    return 1


def _pipe_comm(run: RunModel, count, shape: ModelShape, mine: dict, trainable, live: LiveFacts) -> dict:
    """Logged bytes per step of one pipeline rank by group: dp (at the step boundary), p2p, tp, tied embedding."""
    d, prec, stage = run.degrees, run.precision, live.pipe_stage
    seq_len, micro, m = run.sequence.seq_len, run.batch.micro_batch, run.batch.grad_accum
    return {"dp": comm.comm_bytes_per_step(mine["params"], stage=run.zero.stage, zero_shards=d.zero_shards, precision=prec,
                                           grad_accum=1 if run.zero.stage <= 1 else m, trainable_params=trainable),
            "pp": pipeline.p2p_bytes(shape, workload(run), stage=stage, pp=d.pp, micro_batches=m, tp=d.tp,
                                     partitioned=run.pipe_partitioned),
            "tp": {"all_reduce": pipeline.tp_allreduce_bytes(
                shape, tp=d.tp, blocks=mine["blocks"], seq_len=seq_len, micro_batch=micro, micro_batches=m,
                precision=prec, activation_checkpointing=run.sequence.activation_checkpointing)},
            "tied": {"all_reduce": 0 if trainable is not None else pipeline.tied_allreduce_bytes(  # frozen: no grad
                count, stage=stage, pp=d.pp, precision=prec, bf16_optimizer=live.bf16_optimizer)}}


def pipeline_rank(run: RunModel, live: LiveFacts) -> dict:
    """Model states, activations and logged comm bytes per step of one pipeline rank (its stage: live.pipe_stage),
    the planner's partition beside the engine's."""
    d, z, stage, method = run.degrees, run.zero, live.pipe_stage, run.pipeline_partition
    count, shape, m = model_count(run), model_shape(dict(run.model_config)), run.batch.grad_accum
    tp_counted = counted_tp(run, count, live.parts)
    mine = pipeline.stages(count, d.pp, method, d.tp, tp_counted)[stage]
    trainable = count.trainable_params(mine["blocks"], d.tp)
    lora = {} if trainable is None else {"trainable": trainable,
                                         "largest_trainable_tensor": count.lora_largest_tensor}
    held = memory.Holding(mine["params"], largest_tensor=live.largest_tensor, optimizer_states=run.optimizer_states,
                          **lora, **holding(run.optimizer_dtypes, mine["params"], count))
    zero = Zero(z.stage, z.offload_optimizer, buckets=z.buckets)
    states = {phase: memory.model_state_bytes(held, zero, zero_shards=d.zero_shards, precision=run.precision, grad_accum=m,
                                             phase=phase)
              for phase in memory.PHASES}
    groups = _pipe_comm(run, count, shape, mine, trainable, live)
    total: dict = {}
    for part in groups.values():
        for op, nbytes in part.items():
            if nbytes:
                total[op] = total.get(op, 0) + int(nbytes)
    # 1F1B: stage s holds min(pp - s, m) micro-batches' activations; the last stage computes the logits
    work = Workload(run.sequence.seq_len, run.batch.micro_batch, run.precision,
                    run.sequence.activation_checkpointing)  # no mask counted: a pipeline's blocks see hidden states
    acts = memory.activation_bytes(shape, work, tp=d.tp, num_layers=mine["blocks"],
                                   micro_batches_in_flight=min(d.pp - stage, m), with_logits=stage == d.pp - 1)
    out = {"activations": acts, "peak_total_bytes": memory.training_peak(states.get, acts["total"]),
           "params_per_rank": mine["params"], "dp": d.dp, "tp": d.tp, "pp": d.pp, "stage": z.stage,
           "pipe_stage": stage, "partition_method": method,
           "parts_planned": pipeline.partition(count, d.pp, method, d.tp, tp_counted),
           "stage_layers": mine["names"], "micro_batches": m, "bubble_fraction": pipeline.bubble_fraction(d.pp, m),
           "after_step": states["after_step"], "peak": states["peak"], "comm": total,
           "comm_by_group": {g: {op: n for op, n in part.items() if n} for g, part in groups.items()},
           "notes": [f"pipeline: stage {stage} of {d.pp} holds layers {mine['layers'][0]}..{mine['layers'][1] - 1} "
                     f"({', '.join(mine['names'])}) by partition_method {method}"]}
    return _engine_notes(out, live)


def _engine_notes(out: dict, live: LiveFacts) -> dict:
    parts = list(live.parts)
    out["parts_engine"] = parts
    if parts and parts != out["parts_planned"]:
        out["notes"].append(f"the engine split the layers {parts}, the planner {out['parts_planned']}: "
                            "the planner's layer list differs from the PipelineModule's")
    if live.total != out["params_per_rank"]:
        out["notes"].append(f"this rank holds {live.total:,} parameters, the planner says {out['params_per_rank']:,}")
    return out
