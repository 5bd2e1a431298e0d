"""One candidate layout at a time: what it is (Candidate), which apply to a world size, and what it costs there in
memory and traffic against the hardware given (evaluate), with the --set overrides and launch line that run it.

decide.py walks these in the decision order and names the first that fits; search.py times them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

from harness.planner import comm, memory, moe, pipeline, reference, sequence, teacher
from harness.planner import optimizer as opt_widths
from harness.config.defaults import PRECISION_BYTES, TILE_TOKENS
from harness.config.run_model import Zero
from harness.planner.inputs import Cluster, LongContext, Workload
from harness.planner.shape import ModelShape
from harness.planner.params import ParamCount

PP_MICRO_BATCHES_PER_STAGE = 4  # m = 4p keeps the bubble (p-1)/(m+p-1) under 20%


@dataclass(frozen=True)
class Candidate:
    recipe: str
    stage: int
    offload_optimizer: str = "none"
    offload_param: str = "none"
    tp: int = 1
    pp: int = 1
    sp: int = 1  # the long-context rung (sequence.py): Ulysses degree, tiled MLP and loss,
    tiled: bool = False  # activations "checkpoint" (forced on) or "offload" (checkpointed inputs in CPU RAM);
    act: str = ""  # "" = the workload's --activation-checkpointing
    ep: int = 1  # expert parallelism (DeepSpeed AutoEP, parallel.expert): MoE models only (moe/parallel.py)
    states: str = ""  # "bf16": the bf16 master weights + optimizer states rung (planner/optimizer.py); "": the run's

    @property
    def label(self) -> str:
        parts = [self.recipe if self.recipe in ("ddp", "pipeline", "3d", "tp") else f"zero{self.stage}"]
        if self.recipe in ("tp", "pipeline", "3d"):
            parts.append(f"zero{self.stage}")
        if self.tp > 1:
            parts.append(f"tp{self.tp}")
        if self.pp > 1:
            parts.append(f"pp{self.pp}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.states:
            parts.append(f"{self.states}-states")
        if self.offload_optimizer != "none":
            parts.append(f"opt->{self.offload_optimizer}")
        if self.offload_param != "none":
            parts.append(f"params->{self.offload_param}")
        parts += [f"sp{self.sp}"] * (self.sp > 1) + ["tiled"] * self.tiled
        parts += {"checkpoint": ["ckpt"], "offload": ["ckpt->cpu"]}.get(self.act, [])
        return " ".join(parts)

    def checkpointing(self, work: Workload) -> bool:
        return bool(self.act) or work.activation_checkpointing


def long_context_rung(gpus_per_node: int, shape: ModelShape, offload: bool = True, nvme: bool = False) -> list[Candidate]:
    """For a sequence one rank cannot hold, after every other rung: ZeRO-3 with activation checkpointing, then
    tiled MLP and loss, then Ulysses SP inside a node (each degree the heads allow), then the checkpointed
    activations offloaded to CPU RAM at each degree (ALST's order, arXiv 2506.13996 s3). Then the same steps again
    with the model states offloaded, optimizer and parameters in CPU RAM (then on NVMe when there is one): ALST's
    500K tokens on one H100 run so. They come last because every step then moves the weights over PCIe and runs
    Adam on the CPU, dearer than moving the checkpointed activations. offload False: no activation-offload rows."""
    sps = [1] + sequence.sp_degrees(gpus_per_node, shape)
    states = [("zero3", "none"), ("zero3_offload", "cpu")] + [("zero3_nvme", "nvme")] * nvme
    out = []
    for recipe, device in states:
        z3 = partial(Candidate, recipe, 3, device, device)
        out += [z3(act="checkpoint"), z3(tiled=True, act="checkpoint")]
        out += [z3(sp=s, tiled=True, act="checkpoint") for s in sps[1:]]
        out += [z3(sp=s, tiled=True, act="offload") for s in sps if offload]
    return out


def candidate_of(r: dict) -> Candidate:
    """The Candidate an evaluated result describes."""
    return Candidate(r["recipe"], r["zero_stage"], r["offload_optimizer"], r["offload_param"], r["tp"], r["pp"],
                     r.get("sp", 1), r.get("tiled", False), r.get("act", ""), r.get("ep", 1), r.get("states", ""))


def candidates(world: int, gpus_per_node: int, num_layers: int, shape: ModelShape | None = None,
               activation_offload: bool = True, num_experts: int = 0, nvme: bool = False,
               bf16_states_rung: bool = False) -> list[Candidate]:
    """Every strategy in decision order (cheapest in traffic and complexity first); with the model's shape, the
    long-context rung last (activation_offload False: without its offload rows, e.g. on CPU ranks, where DeepSpeed's
    activation offload does nothing and the harness refuses it; nvme: with its NVMe rows, when there is NVMe). A MoE
    model's expert-parallel layouts come after ZeRO-3 (with leaves), before offload. bf16_states_rung: ZeRO-2 and
    ZeRO-3 with bf16 master weights and optimizer states after the exact ZeRO-3, before offload (a bf16 master
    copy costs loss: planner/optimizer.py)."""
    out = [Candidate("ddp", 0), Candidate("zero1", 1), Candidate("zero2", 2), Candidate("zero3", 3)]
    if bf16_states_rung:
        out += [Candidate(opt_widths.RUNG_RECIPE, 2, states="bf16"), Candidate("zero3", 3, states="bf16")]
    out += [Candidate(f"zero{stage}", stage, ep=ep) for ep in moe.ep_degrees(world, gpus_per_node, num_experts)
            for stage in moe.EP_STAGES]
    out += [Candidate("zero2_offload", 2, "cpu"), Candidate("zero3_offload", 3, "cpu"),
           Candidate("zero3_offload", 3, "cpu", "cpu"), Candidate("zero3_nvme", 3, "nvme", "nvme")]
    tps = [t for t in range(2, gpus_per_node + 1) if gpus_per_node % t == 0]  # never across nodes
    out += [Candidate("tp", stage, tp=t) for t in tps for stage in (1, 2, 3)]
    splits = [(t, p) for t in [1] + tps for p in range(2, min(world // t, num_layers) + 1)
              if (world // t) % p == 0]
    for t, p in sorted(splits, key=lambda tp_pp: (tp_pp[0] * tp_pp[1], tp_pp[1])):
        out.append(Candidate("pipeline" if t == 1 else "3d", 1, tp=t, pp=p))
    return out + (long_context_rung(gpus_per_node, shape, activation_offload, nvme) if shape else [])


def not_applicable(c: Candidate, shape: ModelShape) -> str | None:
    """Why a split cannot be built for this model, or None (tensor parallel: the harness's own TP layers,
    model_shapes.tp_problems; a pipeline: the families harness/model/parallel/pipeline.py converts, and no
    more stages than blocks)."""
    from harness.model_shapes import PIPELINE_FAMILIES, tp_problems

    if c.ep > 1:
        return moe.ep_problem(shape.model_type, shape.num_experts, c.ep)
    if shape.vision:
        from harness.config.vision_rules import layout_refusal

        return layout_refusal(shape.model_type, c.tp, c.pp, c.sp)
    problems = tp_problems(shape.to_dict(), c.tp)
    if problems:
        return "; ".join(what for what, _ in problems)
    if sequence.sp_problem(shape, c.sp):
        return sequence.sp_problem(shape, c.sp)
    if c.pp > 1 and shape.model_type not in PIPELINE_FAMILIES:
        return f"the harness cannot split {shape.model_type} models into pipeline stages"
    return None


def rank_params(c: Candidate, count: ParamCount) -> tuple[int, int]:
    """(parameters on the fullest rank before ZeRO sharding, its block count): the largest pipeline stage
    by DeepSpeed's own partition (planner/pipeline.py), block weights split by tp; embeddings, head and
    norms stay whole on each tensor-parallel rank, a tied embedding on both end stages."""
    if c.ep > 1:
        return moe.rank_params(count, c.ep), count.num_layers
    if c.pp == 1:
        return count.total - count.num_layers * (count.per_layer - count.block_params(c.tp)), count.num_layers
    fullest = max(pipeline.stages(count, c.pp, "parameters", c.tp), key=lambda s: s["params"])
    return fullest["params"], fullest["blocks"]


def micro_batches(c: Candidate, grad_accum: int) -> int:
    if c.pp > 1 and grad_accum <= 1:
        return PP_MICRO_BATCHES_PER_STAGE * c.pp
    return grad_accum


@dataclass(frozen=True)
class RankShare:
    """What the fullest rank of a layout holds and steps: its parameters before ZeRO sharding, its blocks, the ZeRO
    group they shard over (the replicas and each one's sp ranks: Degrees.zero_shards), the micro-batches per step
    and, under ZeRO-3, the parameters kept whole (under the persistence threshold)."""

    params: int
    blocks: int
    zero_shards: int
    micro_batches: int
    persistent: int


def rank_share(c: Candidate, count: ParamCount, shape: ModelShape, cluster: Cluster, work: Workload) -> RankShare:
    params, blocks = rank_params(c, count)
    threshold = memory.harness_buckets(shape.hidden_size).param_persistence_threshold
    return RankShare(params, blocks, cluster.world // (c.tp * c.pp), micro_batches(c, work.grad_accum),
                     count.persistent_numel(threshold) if c.stage == 3 else 0)


def _states(c: Candidate, count: ParamCount, shape: ModelShape, work: Workload, share: RankShare):
    """states(phase, convention) -> this rank's model-state bytes (memory.model_state_bytes, moe's under AutoEP)."""
    buckets = memory.harness_buckets(shape.hidden_size)
    largest_layer = count.largest_layer
    if c.stage == 3 and count.moe_block:  # ZeRO-3 with leaves gathers a sparse block whole (moe/parallel.py)
        largest_layer = max(largest_layer, count.moe_block)
    if c.tp > 1:  # block matrices are split; the embedding and head are not
        largest_layer = max(count.largest_layer // c.tp, shape.vocab_size * shape.hidden_size)
    lora = count.lora_state_args(share.blocks, c.tp)
    zero = Zero(c.stage, c.offload_optimizer, c.offload_param, buckets)
    dtypes = opt_widths.dtypes_for(c, work)
    gathers = opt_widths.gathers_of(dtypes, c.stage, count, share.zero_shards, buckets, work.precision) \
        if share.params >= count.total else {}  # ZeRO-3 Muon's cached gathers, when the rank's group holds it all
    held = memory.Holding(share.params, largest_layer, count.largest_tensor, optimizer_states=work.optimizer_states,
                          **lora, **opt_widths.holding(dtypes, share.params, count, share.zero_shards), **gathers)
    common = dict(zero_shards=share.zero_shards, precision=work.precision)

    def states(phase: str, convention: str = "deepspeed") -> dict:
        if convention == "seed":
            return memory.model_state_bytes(held, zero, **common, convention="seed")
        if c.ep > 1:
            return moe.model_state_bytes(count, held, zero, ep=c.ep, **common, grad_accum=share.micro_batches,
                                         phase=phase)
        return memory.model_state_bytes(replace(held, persistent=share.persistent), zero, **common,
                                        grad_accum=share.micro_batches, phase=phase)

    return states


def evaluate(c: Candidate, count: ParamCount, shape: ModelShape, cluster: Cluster, work: Workload) -> dict:
    """Memory per rank, traffic per step and the verdict for one candidate."""
    share = rank_share(c, count, shape, cluster, work)
    m, params, layers = share.micro_batches, share.params, share.blocks
    states_at = _states(c, count, shape, work, share)
    states = states_at("peak")
    moe_shape = shape.but(intermediate_size=moe.activation_width(count, shape.hidden_size, shape.intermediate_size))
    acts = activations(c, moe_shape, work, layers, min(c.pp, m))
    device = memory.by_device(states)
    device["cpu"] += acts["cpu_offload"]
    result = {
        "recipe": c.recipe, "label": c.label, "zero_stage": c.stage, "offload_optimizer": c.offload_optimizer,
        "offload_param": c.offload_param, "tp": c.tp, "pp": c.pp, "dp": share.zero_shards, "micro_batches": m,
        "sp": c.sp, "tiled": c.tiled, "act": c.act, "activation_offload_bytes_per_rank": acts["cpu_offload"],
        "params_per_rank": params, "trainable_per_rank": count.trainable_params(layers, c.tp) or params,
        "blocks_per_rank": layers, "bubble_fraction": pipeline.bubble_fraction(c.pp, m),
        "memory": {
            "model_states": states, "activations": acts,
            "gpu_bytes": memory.training_peak(states_at, acts["total"]),
            "gpu_backward_bytes": memory.by_device(states_at("backward"))["gpu"] + acts["total"],
            "gpu_step_bytes": memory.by_device(states_at("step"))["gpu"],
            "cpu_bytes_per_rank": device["cpu"], "cpu_bytes_per_node": device["cpu"] * cluster.gpus_per_node,
            "nvme_bytes_per_node": device["nvme"] * cluster.gpus_per_node,
            "seed_model_states": memory.by_device(states_at("peak", "seed")),
        },
        "comm": _comm(c, count, shape, work, share),
    }
    _add_layout_details(result, c, count, share)
    if work.terms in ("pairs", "rollouts"):  # the registry's planner field: a reference per mode
        _add_reference(result, c, count, shape, cluster, work, share)
    elif work.terms == "distill":
        teacher.attach(result, c, bool(count.lora_per_layer), cluster, work,
                       _swap_bytes(c, shape, work, work.teacher.largest_tensor))
    result.update(_verdict(c, result["memory"], shape, cluster))
    teacher_used = (result["memory"].get("teacher") or {"mode": True})["mode"]
    if result["fits"] and not teacher_used:  # no teacher mode fits this layout (planner/teacher.recommend)
        result.update(fits=False, why_not=f"teacher: {result['memory']['teacher']['why']}")
    if work.objective and result["applicable"] and reference.refused(c, work.objective):
        result.update(applicable=False, fits=False, why_not=reference.refused(c, work.objective))
    if result["applicable"] and opt_widths.refusal(c, work):
        result.update(applicable=False, fits=False, why_not=opt_widths.refusal(c, work))
    if c.states:
        result.update(states=c.states, states_cost=opt_widths.RUNG_COST)
    if result["applicable"] and work.seq_len % c.sp:
        result.update(applicable=False, fits=False, why_not=f"seq_len {work.seq_len} does not divide by sp {c.sp}")
    if result["applicable"] and c.sp > 1 and work.attention == "eager":
        result.update(applicable=False, fits=False, why_not="eager attention is refused under sp (an S^2 float mask)")
    return result


def _add_layout_details(result: dict, c: Candidate, count: ParamCount, share: RankShare) -> None:
    """A MoE model's expert facts; a pipeline's stages, so the text can show which one is the largest."""
    if count.num_experts:
        result["ep"] = c.ep
        result["moe"] = {"total_params": count.total, "active_params": count.active, "leaves": c.stage == 3,
                         "optimizer_shard": moe.optimizer_shard(count, c.ep, c.stage, share.zero_shards)}
        if c.stage == 3:
            result["label"] = f"{c.label} leaves"
    if c.pp > 1:
        result["stages"] = [{k: s[k] for k in ("stage", "layers", "blocks", "params")}
                            for s in pipeline.stages(count, c.pp, "parameters", c.tp)]


def _add_reference(result: dict, c: Candidate, count: ParamCount, shape: ModelShape, cluster: Cluster,
                   work: Workload, share: RankShare) -> None:
    """A preference or RL objective's reference (planner/reference.py), its engine sharded like this layout's ZeRO-3."""
    reference.attach(result, c, count, cluster, work, share.persistent,
                     _swap_bytes(c, shape, work, count.largest_tensor or 0))


def _swap_bytes(c: Candidate, shape: ModelShape, work: Workload, largest_tensor: int) -> int:
    """A frozen engine's NVMe parameter swap buffers in host RAM (offload_param nvme), with the policy's buckets."""
    if c.offload_param != "nvme":
        return 0
    b = memory.harness_buckets(shape.hidden_size)
    return b.param_swap_buffer_count * PRECISION_BYTES[work.precision] * max(b.param_swap_buffer_elems, largest_tensor)


def activations(c: Candidate, shape: ModelShape, work: Workload, layers: int, in_flight: int = 1) -> dict:
    """memory.activation_bytes for this layout and workload (its sp, tiling, checkpointing, attention)."""
    long_context = LongContext(c.sp, c.tiled, c.tiled, c.act == "offload")
    return memory.activation_bytes(shape, work.but(activation_checkpointing=c.checkpointing(work)), tp=c.tp,
                                   long_context=long_context, num_layers=layers, micro_batches_in_flight=in_flight)


def _comm(c: Candidate, count: ParamCount, shape: ModelShape, work: Workload, share: RankShare) -> dict:
    params, layers, zero_shards, m, persistent = (share.params, share.blocks, share.zero_shards, share.micro_batches,
                                                  share.persistent)
    prec, seq, mb = work.precision, work.seq_len, work.micro_batch
    if c.ep > 1:
        rows = comm.comm_rows(moe.comm_groups(count, work, ep=c.ep, stage=c.stage, zero_shards=zero_shards,
                                              hidden=shape.hidden_size))
        return {"rows": rows, "wire_bytes": sum(r["wire_bytes"] for r in rows),
                "logged_bytes": sum(r["logged_bytes"] for r in rows)}
    dp = comm.comm_bytes_per_step(params, stage=c.stage, zero_shards=zero_shards, precision=prec, grad_accum=m,
                                  persistent_params=persistent,
                                  gathers_per_micro_step=comm.zero3_gathers(params - persistent),
                                  trainable_params=count.trainable_params(layers, c.tp))
    groups, note = {"dp": (dp, zero_shards)}, None
    if share.params >= count.total:  # ZeRO-3 Muon's own gathers in the step, over the ZeRO group (steptime)
        dtypes, buckets = opt_widths.dtypes_for(c, work), memory.harness_buckets(shape.hidden_size)
        muon_groups = opt_widths.groups_of(dtypes, c.stage, count, zero_shards, buckets)
        if muon := opt_widths.comm(dtypes, c.stage, muon_groups, zero_shards, buckets, prec):
            groups["muon"] = (muon, zero_shards)
        note = opt_widths.chunk_note(dtypes, c.stage, muon_groups, zero_shards, buckets, prec)
    if c.tp > 1:
        groups["tp"] = ({"all_reduce": pipeline.tp_allreduce_bytes(
            shape, tp=c.tp, blocks=layers, seq_len=seq, micro_batch=mb, micro_batches=m, precision=prec,
            activation_checkpointing=work.activation_checkpointing)}, c.tp)
    if c.pp > 1:  # a middle stage (two neighbours) when there is one
        middle = 1 if c.pp > 2 else 0
        p2p = pipeline.p2p_bytes(shape, work, stage=middle, pp=c.pp, micro_batches=m, tp=c.tp)
        gathers = p2p.pop("all_gather_into_tensor", 0)
        groups["pp"] = (p2p, c.pp)
        if gathers:
            groups["tp-pipe"] = ({"all_gather_into_tensor": gathers}, c.tp)
        tied = pipeline.tied_allreduce_bytes(count, stage=0, pp=c.pp, precision=prec)
        if tied:
            groups["pp-tied"] = ({"all_reduce": tied}, 2)
    if c.sp > 1:
        groups["sp"] = (sequence.a2a_bytes_per_step(shape, seq_len=seq, micro_batch=mb, micro_batches=m, sp=c.sp,
                                                    blocks=layers, precision=prec,
                                                    activation_checkpointing=c.checkpointing(work)), c.sp)
    rows = comm.comm_rows(groups)
    return {"rows": rows, "wire_bytes": sum(r["wire_bytes"] for r in rows),
            "logged_bytes": sum(r["logged_bytes"] for r in rows), **({"muon_note": note} if note else {})}


def _verdict(c: Candidate, mem: dict, shape: ModelShape, cluster: Cluster) -> dict:
    reasons = []
    reason = not_applicable(c, shape)
    if reason:
        return {"applicable": False, "fits": False, "why_not": reason}
    usable_gpu = cluster.usable_gpu_bytes
    if mem["gpu_bytes"] > usable_gpu:
        acts = mem["activations"]["total"]
        reasons.append(f"GPU: needs {gb(mem['gpu_bytes'])} > {gb(usable_gpu)} usable (backward: model states "
                       f"{gb(mem['gpu_backward_bytes'] - acts)} + activations {gb(acts)}; optimizer step "
                       f"{gb(mem['gpu_step_bytes'])})")
    cpu = mem["cpu_bytes_per_node"]
    if cpu and cluster.usable_cpu_bytes is not None and cpu > cluster.usable_cpu_bytes:
        reasons.append(f"CPU RAM: needs {gb(cpu)}/node for offload > {gb(cluster.usable_cpu_bytes)} usable")
    nvme = mem["nvme_bytes_per_node"]
    if nvme and cluster.usable_nvme_bytes is None:
        reasons.append(f"NVMe: needs {gb(nvme)}/node, none given (--nvme)")
    elif nvme and nvme > cluster.usable_nvme_bytes:
        reasons.append(f"NVMe: needs {gb(nvme)}/node > {gb(cluster.usable_nvme_bytes)} usable")
    return {"applicable": True, "fits": not reasons, "why_not": "; ".join(reasons) or None}


def gb(nbytes: float) -> str:
    """Decimal units (GB = 1e9 bytes), as GPUs are sold; render/text.py shows GiB next to them."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{int(nbytes)} B"


def overrides(c: Candidate, result: dict, work: Workload) -> dict:
    """The runner's --set overrides that reproduce this plan with the named recipe."""
    # All three batch keys: a recipe may pin the global batch (zero2_offload: 256), and "auto" derives
    # it from micro x accum x data-parallel size for the world the launch finds.
    out = {"batch.micro_batch_per_gpu": work.micro_batch, "batch.grad_accum_steps": result["micro_batches"],
           "batch.train_batch_size": "auto", "train.seq_len": work.seq_len, "precision": work.precision}
    if work.objective:
        out["train.objective"] = work.objective
    if work.terms == "rollouts":  # an RL row is the rl block's prompt + completion, not train.seq_len
        del out["train.seq_len"]
        out.update({"rl.max_prompt_length": work.prompt_len, "rl.max_completion_length": work.completion_len})
    if c.checkpointing(work):
        out["activation_checkpointing"] = True
    if work.packing != "document":  # the recipes' default; the plan's pipeline traffic assumed this one
        out["train.packing"] = work.packing
    if c.sp > 1:  # sp-core's keys (issue #24)
        out["parallel.sequence"] = c.sp
    if c.tiled:
        out["train.tiled_mlp"] = out["train.tiled_loss"] = True
    if c.act == "offload":
        out["train.activation_offload"] = True
    if c.recipe.endswith(("_offload", "_nvme")):
        out["zero.offload_optimizer"] = c.offload_optimizer
        if c.stage == 3:
            out["zero.offload_param"] = c.offload_param
    if c.recipe in ("tp", "pipeline", "3d"):
        out["zero.stage"] = c.stage
    out.update(opt_widths.overrides(c, work))
    if c.tp > 1:
        out["parallel.tensor"] = c.tp
    if c.pp > 1:
        out["parallel.pipeline"] = c.pp
    if c.ep > 1:
        out["parallel.expert"] = c.ep
    return out


def hardware(gpus_per_node: int, nodes: int, gpu_mem_bytes: int, cpu_mem_bytes: int | None,
             nvme_bytes: int | None) -> Cluster:
    return Cluster(gpus_per_node, gpu_mem_bytes, nodes, cpu_mem_bytes, nvme_bytes)
