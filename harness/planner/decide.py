"""The seeds' decision order: stop at the first strategy that fits.

DDP -> ZeRO-1 -> ZeRO-2 -> ZeRO-3 -> offload the optimizer (ZeRO-2, then ZeRO-3), then the parameters
(CPU, then NVMe) -> tensor parallel inside a node -> pipeline (across nodes) with tensor parallel inside
and data parallel across replicas (3D). Every candidate is evaluated so the output can say why each
cheaper one fails.

Fit is judged on memory alone, as the seeds order it. By that measure a pipeline rarely wins: its first
stage keeps min(p, m) micro-batches of L/p blocks in flight under 1F1B (as many activations as no
pipeline when m >= p), and ZeRO-3 already spreads model states over every GPU. Pipelines pay off in
traffic across slow inter-node links, which the wire column shows but the decision does not weigh.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from harness.planner import comm, memory, pipeline
from harness.planner.params import ParamCount

RESERVE_FRACTION = 0.10  # of GPU, CPU and NVMe: CUDA context, NCCL buffers, fragmentation, the OS
PP_MICRO_BATCHES_PER_STAGE = 4  # m = 4p keeps the bubble (p-1)/(m+p-1) under 20%


@dataclass(frozen=True)
class Candidate:
    recipe: str
    stage: int
    offload_optimizer: str = "none"
    offload_param: str = "none"
    tp: int = 1
    pp: int = 1

    @property
    def label(self) -> str:
        parts = [self.recipe if self.recipe in ("ddp", "pipeline", "3d", "tp") else f"zero{self.stage}"]
        if self.recipe in ("tp", "pipeline", "3d"):
            parts.append(f"zero{self.stage}")
        if self.tp > 1:
            parts.append(f"tp{self.tp}")
        if self.pp > 1:
            parts.append(f"pp{self.pp}")
        if self.offload_optimizer != "none":
            parts.append(f"opt->{self.offload_optimizer}")
        if self.offload_param != "none":
            parts.append(f"params->{self.offload_param}")
        return " ".join(parts)


def candidates(world: int, gpus_per_node: int, num_layers: int) -> list[Candidate]:
    """Every strategy in decision order (cheapest in traffic and complexity first)."""
    out = [Candidate("ddp", 0), Candidate("zero1", 1), Candidate("zero2", 2), Candidate("zero3", 3),
           Candidate("zero2_offload", 2, "cpu"), Candidate("zero3_offload", 3, "cpu"),
           Candidate("zero3_offload", 3, "cpu", "cpu"), Candidate("zero3_nvme", 3, "nvme", "nvme")]
    tps = [t for t in range(2, gpus_per_node + 1) if gpus_per_node % t == 0]  # never across nodes
    out += [Candidate("tp", stage, tp=t) for t in tps for stage in (1, 2, 3)]
    splits = [(t, p) for t in [1] + tps for p in range(2, min(world // t, num_layers) + 1)
              if (world // t) % p == 0]
    for t, p in sorted(splits, key=lambda tp_pp: (tp_pp[0] * tp_pp[1], tp_pp[1])):
        out.append(Candidate("pipeline" if t == 1 else "3d", 1, tp=t, pp=p))
    return out


def not_applicable(c: Candidate, shape: dict) -> str | None:
    """Why a split cannot be built for this model, or None (tensor parallel: the harness's own TP layers,
    model_shapes.tp_problems; a pipeline: the families harness/train/parallel/pipeline.py converts, and no
    more stages than blocks)."""
    from harness.model_shapes import PIPELINE_FAMILIES, tp_problems

    problems = tp_problems(shape, c.tp)
    if problems:
        return "; ".join(what for what, _ in problems)
    if c.pp > 1 and shape["model_type"] not in PIPELINE_FAMILIES:
        return f"the harness cannot split {shape['model_type']} models into pipeline stages"
    return None


def rank_params(c: Candidate, count: ParamCount) -> tuple[int, int]:
    """(parameters on the fullest rank before ZeRO sharding, its block count): the largest pipeline stage
    by DeepSpeed's own partition (planner/pipeline.py), block weights split by tp; embeddings, head and
    norms stay whole on each tensor-parallel rank, a tied embedding on both end stages."""
    if c.pp == 1:
        return count.total - count.num_layers * (count.per_layer - count.block_params(c.tp)), count.num_layers
    fullest = max(pipeline.stages(count, c.pp, "parameters", c.tp), key=lambda s: s["params"])
    return fullest["params"], fullest["blocks"]


def micro_batches(c: Candidate, grad_accum: int) -> int:
    if c.pp > 1 and grad_accum <= 1:
        return PP_MICRO_BATCHES_PER_STAGE * c.pp
    return grad_accum


def evaluate(c: Candidate, count: ParamCount, shape: dict, hw: dict, work: dict) -> dict:
    """Memory per rank, traffic per step and the verdict for one candidate."""
    world = hw["gpus_per_node"] * hw["nodes"]
    dp = world // (c.tp * c.pp)
    m = micro_batches(c, work["grad_accum"])
    params, layers = rank_params(c, count)
    buckets = memory.harness_buckets(shape["hidden_size"])
    persistent = count.persistent_numel(buckets.param_persistence_threshold) if c.stage == 3 else 0
    largest_layer = count.largest_layer
    if c.tp > 1:  # block matrices are split; the embedding and head are not
        largest_layer = max(count.largest_layer // c.tp, shape["vocab_size"] * shape["hidden_size"])
    common = dict(stage=c.stage, dp=dp, precision=work["precision"], offload_optimizer=c.offload_optimizer,
                  offload_param=c.offload_param, **count.lora_state_args(layers, c.tp))
    def states_at(phase: str) -> dict:
        return memory.model_state_bytes(params, **common, largest_layer_params=largest_layer,
                                        largest_tensor_params=count.largest_tensor, persistent_params=persistent,
                                        buckets=buckets, grad_accum=m, phase=phase)

    states = states_at("peak")
    seed = memory.model_state_bytes(params, **common, convention="seed")
    acts = memory.activation_bytes(
        shape, seq_len=work["seq_len"], micro_batch=work["micro_batch"], precision=work["precision"],
        activation_checkpointing=work["activation_checkpointing"], tp=c.tp, num_layers=layers,
        micro_batches_in_flight=min(c.pp, m))
    device = memory.by_device(states)
    result = {
        "recipe": c.recipe, "label": c.label, "zero_stage": c.stage, "offload_optimizer": c.offload_optimizer,
        "offload_param": c.offload_param, "tp": c.tp, "pp": c.pp, "dp": dp, "micro_batches": m,
        "params_per_rank": params, "trainable_per_rank": count.trainable_params(layers, c.tp) or params,
        "blocks_per_rank": layers, "bubble_fraction": pipeline.bubble_fraction(c.pp, m),
        "memory": {
            "model_states": states, "activations": acts,
            "gpu_bytes": memory.training_peak(states_at, acts["total"]),
            "gpu_backward_bytes": memory.by_device(states_at("backward"))["gpu"] + acts["total"],
            "gpu_step_bytes": memory.by_device(states_at("step"))["gpu"],
            "cpu_bytes_per_rank": device["cpu"], "cpu_bytes_per_node": device["cpu"] * hw["gpus_per_node"],
            "nvme_bytes_per_node": device["nvme"] * hw["gpus_per_node"],
            "seed_model_states": memory.by_device(seed),
        },
        "comm": _comm(c, count, params, layers, dp, m, persistent, shape, work),
    }
    if c.pp > 1:  # every stage, so the text can show which one is the largest
        result["stages"] = [{k: s[k] for k in ("stage", "layers", "blocks", "params")}
                            for s in pipeline.stages(count, c.pp, "parameters", c.tp)]
    result.update(_verdict(c, result["memory"], shape, hw))
    return result


def _comm(c: Candidate, count: ParamCount, params: int, layers: int, dp: int, m: int, persistent: int,
          shape: dict, work: dict) -> dict:
    prec, seq, mb = work["precision"], work["seq_len"], work["micro_batch"]
    groups = {"dp": (comm.comm_bytes_per_step(params, stage=c.stage, dp=dp, precision=prec, grad_accum=m,
                                              persistent_params=persistent,
                                              trainable_params=count.trainable_params(layers, c.tp)), dp)}
    if c.tp > 1:
        groups["tp"] = ({"all_reduce": pipeline.tp_allreduce_bytes(
            shape, tp=c.tp, blocks=layers, seq_len=seq, micro_batch=mb, micro_batches=m, precision=prec,
            activation_checkpointing=work["activation_checkpointing"])}, c.tp)
    if c.pp > 1:  # a middle stage (two neighbours) when there is one
        middle = 1 if c.pp > 2 else 0
        p2p = pipeline.p2p_bytes(shape, stage=middle, pp=c.pp, seq_len=seq, micro_batch=mb, micro_batches=m,
                                 precision=prec, tp=c.tp)
        gathers = p2p.pop("all_gather_into_tensor", 0)
        groups["pp"] = (p2p, c.pp)
        if gathers:
            groups["tp-pipe"] = ({"all_gather_into_tensor": gathers}, c.tp)
        tied = pipeline.tied_allreduce_bytes(count, stage=0, pp=c.pp, precision=prec)
        if tied:
            groups["pp-tied"] = ({"all_reduce": tied}, 2)
    rows = comm.comm_rows(groups)
    return {"rows": rows, "wire_bytes": sum(r["wire_bytes"] for r in rows),
            "logged_bytes": sum(r["logged_bytes"] for r in rows)}


def _verdict(c: Candidate, mem: dict, shape: dict, hw: dict) -> dict:
    reasons = []
    reason = not_applicable(c, shape)
    if reason:
        return {"applicable": False, "fits": False, "why_not": reason}
    usable_gpu = hw["usable_gpu_bytes"]
    if mem["gpu_bytes"] > usable_gpu:
        acts = mem["activations"]["total"]
        reasons.append(f"GPU: needs {gb(mem['gpu_bytes'])} > {gb(usable_gpu)} usable (backward: model states "
                       f"{gb(mem['gpu_backward_bytes'] - acts)} + activations {gb(acts)}; optimizer step "
                       f"{gb(mem['gpu_step_bytes'])})")
    cpu = mem["cpu_bytes_per_node"]
    if cpu and hw["usable_cpu_bytes"] is not None and cpu > hw["usable_cpu_bytes"]:
        reasons.append(f"CPU RAM: needs {gb(cpu)}/node for offload > {gb(hw['usable_cpu_bytes'])} usable")
    nvme = mem["nvme_bytes_per_node"]
    if nvme and hw["usable_nvme_bytes"] is None:
        reasons.append(f"NVMe: needs {gb(nvme)}/node, none given (--nvme)")
    elif nvme and nvme > hw["usable_nvme_bytes"]:
        reasons.append(f"NVMe: needs {gb(nvme)}/node > {gb(hw['usable_nvme_bytes'])} usable")
    return {"applicable": True, "fits": not reasons, "why_not": "; ".join(reasons) or None}


def gb(nbytes: float) -> str:
    """Decimal units (GB = 1e9 bytes), as GPUs are sold; render.py shows GiB next to them."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{int(nbytes)} B"


def overrides(c: Candidate, result: dict, work: dict) -> dict:
    """The runner's --set overrides that reproduce this plan with the named recipe."""
    # All three batch keys: a recipe may pin the global batch (zero2_offload: 256), and "auto" derives
    # it from micro x accum x data-parallel size for the world the launch finds.
    out = {"batch.micro_batch_per_gpu": work["micro_batch"], "batch.grad_accum_steps": result["micro_batches"],
           "batch.train_batch_size": "auto", "train.seq_len": work["seq_len"], "precision": work["precision"]}
    if work["activation_checkpointing"]:
        out["activation_checkpointing"] = True
    if c.recipe.endswith(("_offload", "_nvme")):
        out["zero.offload_optimizer"] = c.offload_optimizer
        if c.stage == 3:
            out["zero.offload_param"] = c.offload_param
    if c.recipe in ("tp", "pipeline", "3d"):
        out["zero.stage"] = c.stage
    if c.tp > 1:
        out["parallel.tensor"] = c.tp
    if c.pp > 1:
        out["parallel.pipeline"] = c.pp
    return out


def launch_command(recipe: str, model_name: str, hw: dict, sets: dict) -> str:
    head = f"harness launch --num_gpus {hw['gpus_per_node']}"  # `deepspeed` that is safe to signal (README)
    if hw["nodes"] > 1:  # DeepSpeed's pdsh launcher: the other nodes' ranks cannot report to `harness launch`
        head = f"deepspeed --hostfile hostfile --num_nodes {hw['nodes']} --num_gpus {hw['gpus_per_node']}"
    args = " ".join(f"--set {k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in sets.items())
    return f"{head} harness/run.py --recipe {recipe} --model {shlex.quote(model_name)} {args}"


@dataclass
class Plan:
    model: dict  # name, parameter count, shape
    hardware: dict  # gpus_per_node, nodes, world, memory given and usable
    workload: dict  # seq_len, micro_batch, precision, activation_checkpointing, grad_accum
    seed: dict  # the seeds' 16 B/param headline: DP and ZeRO-3 model states per GPU
    candidates: list[dict]  # every strategy in decision order, with fits / why_not
    recommended: dict | None  # the first that fits; None when nothing does
    missing: list[str]  # when nothing fits: what would make it fit
    notes: list[str]  # assumptions the recommendation rests on (e.g. CPU RAM not given)
    # with a hardware profile (search.attach): the fitting layouts fastest first (recommended = the first), the
    # seeds' first fit timed at the same global batch, their speed ratio, or one layout evaluated exactly
    profile: dict | None = None
    ranked: list[dict] | None = None
    first_fit: dict | None = None
    comparison: dict | None = None
    evaluated: dict | None = None
    scaling: dict | None = None  # `plan --scaling`: tokens/s per GPU against node count (planner/scaling.py)

    def to_dict(self) -> dict:
        out = {"model": self.model, "hardware": self.hardware, "workload": self.workload, "seed": self.seed,
               "recommended": self.recommended, "missing": self.missing, "notes": self.notes,
               "candidates": self.candidates}
        for key in ("profile", "ranked", "first_fit", "comparison", "evaluated", "scaling"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


def hardware(gpus_per_node: int, nodes: int, gpu_mem_bytes: int, cpu_mem_bytes: int | None,
             nvme_bytes: int | None) -> dict:
    def usable(nbytes):
        return None if nbytes is None else int(nbytes * (1 - RESERVE_FRACTION))

    return {"gpus_per_node": gpus_per_node, "nodes": nodes, "world": gpus_per_node * nodes,
            "gpu_mem_bytes": gpu_mem_bytes, "cpu_mem_bytes": cpu_mem_bytes, "nvme_bytes": nvme_bytes,
            "usable_gpu_bytes": usable(gpu_mem_bytes), "usable_cpu_bytes": usable(cpu_mem_bytes),
            "usable_nvme_bytes": usable(nvme_bytes), "reserve_fraction": RESERVE_FRACTION}


def evaluate_all(count: ParamCount, shape: dict, hw: dict, work: dict, model_name: str) -> list[dict]:
    out = []
    for c in candidates(hw["world"], hw["gpus_per_node"], count.num_layers):
        result = evaluate(c, count, shape, hw, work)
        result["overrides"] = overrides(c, result, work)
        result["launch"] = launch_command(c.recipe, model_name, hw, result["overrides"])
        out.append(result)
    return out


def missing(results: list[dict], count: ParamCount, shape: dict, hw: dict, work: dict) -> list[str]:
    """When nothing fits: what is short, with the amounts, and what would fix it."""
    usable = [r for r in results if r["applicable"]]
    gpu_ok = [r for r in usable if r["memory"]["gpu_bytes"] <= hw["usable_gpu_bytes"]]
    out = []
    cpu_only = [r for r in gpu_ok if not r["memory"]["nvme_bytes_per_node"]]
    if cpu_only:
        r = min(cpu_only, key=lambda r: r["memory"]["cpu_bytes_per_node"])
        need = r["memory"]["cpu_bytes_per_node"] / (1 - RESERVE_FRACTION)
        what = "optimizer offload" if r["offload_param"] == "none" else "optimizer and parameter offload"
        have = f"{gb(hw['cpu_mem_bytes'])} given" if hw["cpu_mem_bytes"] else "none given"
        out.append(f"needs >= {gb(need)} CPU RAM per node for {what} ({r['label']}; {have})")
    nvme = [r for r in gpu_ok if r["memory"]["nvme_bytes_per_node"]]
    if nvme:
        r = min(nvme, key=lambda r: r["memory"]["nvme_bytes_per_node"])
        need = r["memory"]["nvme_bytes_per_node"] / (1 - RESERVE_FRACTION)
        have = f"{gb(hw['nvme_bytes'])} given" if hw["nvme_bytes"] else "none given"
        extra = f", CPU: {r['why_not']}" if "CPU" in (r["why_not"] or "") else ""
        out.append(f"or >= {gb(need)} NVMe per node for ZeRO-Infinity ({r['label']}; {have}{extra})")
    if not gpu_ok:
        leanest = min(usable, key=lambda r: r["memory"]["gpu_bytes"])
        acts = leanest["memory"]["activations"]["total"]
        fix = "use --activation-checkpointing, " if not work["activation_checkpointing"] else ""
        out.append(f"even the leanest option ({leanest['label']}) needs {gb(leanest['memory']['gpu_bytes'])} "
                   f"per GPU, {gb(acts)} of it activations: {fix}lower --micro-batch or --seq-len, "
                   f"or use GPUs with more memory")
    nodes = min_nodes_for_zero3(count, shape, hw, work)
    if nodes:
        out.append(f"or >= {nodes} nodes x {hw['gpus_per_node']} GPU for zero3 without offload")
    return out


def min_nodes_for_zero3(count: ParamCount, shape: dict, hw: dict, work: dict, limit: int = 4096) -> int | None:
    """Smallest node count (beyond the given) at which plain ZeRO-3 fits, by doubling then bisecting."""
    def fits(nodes: int) -> bool:
        probe = dict(hw, nodes=nodes, world=nodes * hw["gpus_per_node"])
        return evaluate(Candidate("zero3", 3), count, shape, probe, work)["fits"]

    lo, hi = hw["nodes"], hw["nodes"] * 2
    while not fits(hi):
        lo, hi = hi, hi * 2
        if hi > limit:
            return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


def seed_headline(count: ParamCount, hw: dict, precision: str) -> dict:
    world = hw["world"]
    dp = memory.model_state_bytes(count.total, stage=0, dp=world, precision=precision, convention="seed")
    z3 = memory.model_state_bytes(count.total, stage=3, dp=world, precision=precision, convention="seed")
    return {"bytes_per_param": 16, "dp_bytes_per_gpu": memory.by_device(dp)["gpu"],
            "zero3_bytes_per_gpu": memory.by_device(z3)["gpu"], "world": world}


def plan(model_cfg: dict, *, gpus_per_node: int, nodes: int = 1, gpu_mem_bytes: int,
         cpu_mem_bytes: int | None = None, nvme_bytes: int | None = None, seq_len: int = 2048,
         micro_batch: int = 1, precision: str = "bf16", activation_checkpointing: bool = False,
         grad_accum: int = 1, model_name: str | None = None, count: ParamCount | None = None,
         hardware_profile: dict | None = None, global_batch: int | None = None, layout: dict | None = None) -> Plan:
    """Evaluate every strategy for this model and hardware; recommend the first that fits.

    cpu_mem_bytes / nvme_bytes are per node. CPU RAM not given: offload is not checked against it (its
    need is still reported). NVMe not given: there is none. `count` skips counting (e.g. a meta count).
    With `hardware_profile` the step-time model ranks the layouts and recommends the fastest (search.attach);
    `layout` ({zero, offload, tp, pp}) evaluates that one layout instead.
    """
    from harness.planner.params import count_params, model_shape

    _check_inputs(gpus_per_node, nodes, gpu_mem_bytes, seq_len, micro_batch, precision, grad_accum)
    shape = model_shape(model_cfg)
    if shape["learned_positions"] and shape["max_positions"] and seq_len > shape["max_positions"]:
        raise ValueError(f"seq_len {seq_len} > the model's {shape['max_positions']} learned positions")
    count = count or count_params(model_cfg)
    hw = hardware(gpus_per_node, nodes, gpu_mem_bytes, cpu_mem_bytes, nvme_bytes)
    work = {"seq_len": seq_len, "micro_batch": micro_batch, "precision": precision,
            "activation_checkpointing": activation_checkpointing, "grad_accum": grad_accum}
    name = model_name or model_cfg.get("_name_or_path") or "MODEL"
    results = evaluate_all(count, shape, hw, work, name)
    best = next((r for r in results if r["fits"]), None)
    result = Plan(model={"name": name, "params": count.to_dict(), "shape": shape}, hardware=hw, workload=dict(work),
                  seed=seed_headline(count, hw, precision), candidates=results, recommended=best,
                  missing=[] if best else missing(results, count, shape, hw, work),
                  notes=notes(best, hw, shape, seq_len))
    if hardware_profile is not None:
        from harness.planner import search

        search.attach(result, count, shape, hw, work, hardware_profile, global_batch, layout)
    return result


def notes(best: dict | None, hw: dict, shape: dict, seq_len: int) -> list[str]:
    out = []
    if shape["max_positions"] and seq_len > shape["max_positions"]:
        out.append(f"seq_len {seq_len} is beyond the model's max_position_embeddings {shape['max_positions']}")
    if not best:
        return out
    cpu = best["memory"]["cpu_bytes_per_node"]
    if cpu and hw["cpu_mem_bytes"] is None:
        out.append(f"CPU RAM not given: {best['recipe']} needs >= {gb(cpu / (1 - RESERVE_FRACTION))} per node "
                   f"for the offloaded states (pass --cpu-mem to check)")
    if hw["nodes"] > 1:
        out.append(f"the launch line reads ./hostfile: one line per node, '<host> slots={hw['gpus_per_node']}' "
                   "(docker/README.md; without ssh: --no_ssh --node_rank N on each node)")
    if best["offload_optimizer"] == "nvme" or best["offload_param"] == "nvme":
        out.append("set zero.nvme_path to a directory on a local NVMe drive (--set zero.nvme_path=/local_nvme)")
    return out


def _check_inputs(gpus_per_node, nodes, gpu_mem_bytes, seq_len, micro_batch, precision, grad_accum) -> None:
    problems = [f"{name} {value!r}: expected an integer >= 1" for name, value in (
        ("gpus_per_node", gpus_per_node), ("nodes", nodes), ("gpu_mem_bytes", gpu_mem_bytes),
        ("seq_len", seq_len), ("micro_batch", micro_batch), ("grad_accum", grad_accum))
        if not isinstance(value, int) or isinstance(value, bool) or value < 1]
    if precision not in memory.PRECISION_BYTES:
        problems.append(f"precision {precision!r}: expected one of {', '.join(memory.PRECISION_BYTES)}")
    if problems:
        raise ValueError("; ".join(problems))
