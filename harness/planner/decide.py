"""The decision order: stop at the first strategy that fits.

DDP -> ZeRO-1 -> ZeRO-2 -> ZeRO-3 -> offload the optimizer (ZeRO-2, then ZeRO-3), then the parameters
(CPU, then NVMe) -> tensor parallel inside a node -> pipeline (across nodes) with tensor parallel inside
and data parallel across replicas (3D) -> for a sequence none of them holds, the long-context rung (ZeRO-3 with
activation checkpointing, then tiled MLP and loss, then Ulysses SP inside a node, then the checkpointed activations
in CPU RAM; then all of these again with the optimizer and parameters in CPU RAM, then on NVMe when given, as
ALST trains 500K tokens on one GPU; layouts.long_context_rung). Every layout reports the longest seq_len it holds
(longest.py). Every candidate is evaluated so the output can say why each cheaper one fails.

Fit is judged on memory alone, in that order. By that measure a pipeline rarely wins: its first
stage keeps min(p, m) micro-batches of L/p blocks in flight under 1F1B (as many activations as no
pipeline when m >= p), and ZeRO-3 already spreads model states over every GPU. Pipelines pay off in
traffic across slow inter-node links, which the wire column shows but the decision does not weigh.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.config.defaults import PRECISION_BYTES
from harness.config.run_model import Zero
from harness.planner import longest, memory
from harness.planner.inputs import RESERVE_FRACTION, Cluster, Workload
from harness.planner.shape import ModelShape
from harness.planner.launch_lines import cluster_commands, launch_command
from harness.planner.layouts import Candidate, candidates, evaluate, gb, overrides
from harness.planner.params import ParamCount
from harness.planner.optimizer import offers_rung

@dataclass
class Plan:
    model: dict  # name, parameter count, shape
    hardware: Cluster  # gpus_per_node, nodes, world, memory given and usable
    workload: Workload  # seq_len, micro_batch, precision, activation_checkpointing, grad_accum, ...
    seed: dict  # the 16 B/param rule of thumb (ZeRO paper): DP and ZeRO-3 model states per GPU
    candidates: list[dict]  # every strategy in decision order, with fits / why_not
    recommended: dict | None  # the first that fits; None when nothing does
    missing: list[str]  # when nothing fits: what would make it fit
    notes: list[str]  # assumptions the recommendation rests on (e.g. CPU RAM not given)
    # with a hardware profile (search.attach): the fitting layouts fastest first (recommended = the first), the
    # first fit in the decision order timed at the same global batch, their speed ratio, or one layout evaluated exactly
    profile: dict | None = None
    ranked: list[dict] | None = None
    first_fit: dict | None = None
    comparison: dict | None = None
    evaluated: dict | None = None
    scaling: dict | None = None  # `plan --scaling`: tokens/s per GPU against node count (planner/scaling.py)

    def to_dict(self) -> dict:
        out = {"model": self.model, "hardware": self.hardware.to_dict(), "workload": self.workload.to_dict(),
               "seed": self.seed,
               "recommended": self.recommended, "missing": self.missing, "notes": self.notes,
               "candidates": self.candidates}
        for key in ("profile", "ranked", "first_fit", "comparison", "evaluated", "scaling"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


def evaluate_all(count: ParamCount, shape: ModelShape, cluster: Cluster, work: Workload, model_name: str) -> list[dict]:
    out = []
    for c in candidates(cluster.world, cluster.gpus_per_node, count.num_layers, shape, work.activation_offload,
                        num_experts=count.num_experts, nvme=cluster.nvme_bytes is not None,
                        bf16_states_rung=offers_rung(work)):
        result = longest.attach(evaluate(c, count, shape, cluster, work), count, shape, cluster, work)
        result["overrides"] = overrides(c, result, work)
        result["launch"] = launch_command(c.recipe, model_name, cluster, result["overrides"])
        result.update(cluster_commands(c.recipe, model_name, cluster, result["overrides"]))
        out.append(result)
    return out


def missing(results: list[dict], count: ParamCount, shape: ModelShape, cluster: Cluster, work: Workload) -> list[str]:
    """When nothing fits: what is short, with the amounts, and what would fix it."""
    usable = [r for r in results if r["applicable"]]
    gpu_ok = [r for r in usable if r["memory"]["gpu_bytes"] <= cluster.usable_gpu_bytes]
    out = []
    cpu_only = [r for r in gpu_ok if not r["memory"]["nvme_bytes_per_node"]]
    if cpu_only:
        r = min(cpu_only, key=lambda r: r["memory"]["cpu_bytes_per_node"])
        need = r["memory"]["cpu_bytes_per_node"] / (1 - RESERVE_FRACTION)
        what = "optimizer offload" if r["offload_param"] == "none" else "optimizer and parameter offload"
        have = f"{gb(cluster.cpu_mem_bytes)} given" if cluster.cpu_mem_bytes else "none given"
        out.append(f"needs >= {gb(need)} CPU RAM per node for {what} ({r['label']}; {have})")
    nvme = [r for r in gpu_ok if r["memory"]["nvme_bytes_per_node"]]
    if nvme:
        r = min(nvme, key=lambda r: r["memory"]["nvme_bytes_per_node"])
        need = r["memory"]["nvme_bytes_per_node"] / (1 - RESERVE_FRACTION)
        have = f"{gb(cluster.nvme_bytes)} given" if cluster.nvme_bytes else "none given"
        extra = f", CPU: {r['why_not']}" if "CPU" in (r["why_not"] or "") else ""
        out.append(f"or >= {gb(need)} NVMe per node for ZeRO-Infinity ({r['label']}; {have}{extra})")
    if not gpu_ok:
        leanest = min(usable, key=lambda r: r["memory"]["gpu_bytes"])
        acts = leanest["memory"]["activations"]["total"]
        fix = "use --activation-checkpointing, " if not work.activation_checkpointing else ""
        top = max(results, key=lambda r: r["max_seq_len"])  # how far --seq-len has to come down
        holds = (f" (the longest of any layout: {top['label']} holds {top['max_seq_len']:,} tokens)"
                 if top["max_seq_len"] else "")
        out.append(f"even the leanest option ({leanest['label']}) needs {gb(leanest['memory']['gpu_bytes'])} "
                   f"per GPU, {gb(acts)} of it activations: {fix}lower --micro-batch or --seq-len{holds}, "
                   f"or use GPUs with more memory")
    nodes = min_nodes_for_zero3(count, shape, cluster, work)
    if nodes:
        out.append(f"or >= {nodes} nodes x {cluster.gpus_per_node} GPU for zero3 without offload")
    return out


def min_nodes_for_zero3(count: ParamCount, shape: ModelShape, cluster: Cluster, work: Workload,
                        limit: int = 4096) -> int | None:
    """Smallest node count (beyond the given) at which plain ZeRO-3 fits, by doubling then bisecting."""
    def fits(nodes: int) -> bool:
        return evaluate(Candidate("zero3", 3), count, shape, cluster.with_nodes(nodes), work)["fits"]

    lo, hi = cluster.nodes, cluster.nodes * 2
    while not fits(hi):
        lo, hi = hi, hi * 2
        if hi > limit:
            return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


def seed_headline(count: ParamCount, cluster: Cluster, precision: str) -> dict:
    world = cluster.world
    held = memory.Holding(count.total)
    ddp = memory.model_state_bytes(held, Zero(stage=0), zero_shards=world, precision=precision, convention="seed")
    z3 = memory.model_state_bytes(held, Zero(stage=3), zero_shards=world, precision=precision, convention="seed")
    return {"bytes_per_param": 16, "dp_bytes_per_gpu": memory.by_device(ddp)["gpu"],
            "zero3_bytes_per_gpu": memory.by_device(z3)["gpu"], "world": world}


def plan(model_cfg: dict, cluster: Cluster, work: Workload, *, model_name: str | None = None,
         count: ParamCount | None = None, hardware_profile: dict | None = None, layout: dict | None = None) -> Plan:
    """Evaluate every strategy for this model on `cluster` training `work`; recommend the first that fits.

    Cluster: CPU RAM not given, offload is not checked against it (its need is still reported); NVMe not given,
    there is none. `count` skips counting (e.g. a meta count). With `hardware_profile` the step-time model ranks
    the layouts at work.global_batch and recommends the fastest (search.attach); `layout` ({zero, offload, tp, pp,
    ep}) evaluates that one layout instead. Every layout reports the longest seq_len it holds (max_seq_len,
    planner/longest.py); for a sequence no earlier layout holds, the long-context rung (checkpointing, tiling,
    Ulysses SP inside a node, activation offload unless work.activation_offload is False) comes last.
    """
    from harness.planner.params import count_params, model_shape

    _check_inputs(cluster, work)
    shape = model_shape(model_cfg)
    if shape.learned_positions and shape.max_positions and work.seq_len > shape.max_positions:
        raise ValueError(f"seq_len {work.seq_len} > the model's {shape.max_positions} learned positions")
    count = count or count_params(model_cfg)
    name = model_name or model_cfg.get("_name_or_path") or "MODEL"
    results = evaluate_all(count, shape, cluster, work, name)
    best = next((r for r in results if r["fits"]), None)
    result = Plan(model={"name": name, "params": count.to_dict(), "shape": shape.to_dict()}, hardware=cluster,
                  workload=work, seed=seed_headline(count, cluster, work.precision), candidates=results,
                  recommended=best, missing=[] if best else missing(results, count, shape, cluster, work),
                  notes=notes(best, cluster, shape, work.seq_len))
    if hardware_profile is not None:
        from harness.planner import search

        search.attach(result, count, shape, cluster, work, hardware_profile, layout)
    return result


def notes(best: dict | None, cluster: Cluster, shape: ModelShape, seq_len: int) -> list[str]:
    out = []
    if shape.max_positions and seq_len > shape.max_positions:
        out.append(f"seq_len {seq_len} is beyond the model's max_position_embeddings {shape.max_positions}")
    if not best:
        return out
    cpu = best["memory"]["cpu_bytes_per_node"]
    if cpu and cluster.cpu_mem_bytes is None:
        what = "the offloaded states"
        if (best["memory"].get("reference") or {}).get("mode") == "precomputed":  # its table is in host RAM
            offloaded = best["offload_optimizer"] != "none"
            what = f"{what} and the precomputed reference" if offloaded else "the precomputed reference log-probs"
        out.append(f"CPU RAM not given: {best['recipe']} needs >= {gb(cpu / (1 - RESERVE_FRACTION))} per node "
                   f"for {what} (pass --cpu-mem to check)")
    if cluster.nodes > 1:
        out.append(f"the launch line reads ./hostfile: one line per node, '<host> slots={cluster.gpus_per_node}' "
                   "(docker/README.md; without ssh: --no_ssh --node_rank N on each node)")
    if best["offload_optimizer"] == "nvme" or best["offload_param"] == "nvme":
        out.append("set zero.nvme_path to a directory on a local NVMe drive (--set zero.nvme_path=/local_nvme)")
    if note := best["comm"].get("muon_note"):  # ZeRO-3 Muon's chunks leave ranks without Newton-Schulz work
        out.append(note)
    return out


def _check_inputs(cluster: Cluster, work: Workload) -> None:
    problems = [f"{name} {value!r}: expected an integer >= 1" for name, value in (
        ("gpus_per_node", cluster.gpus_per_node), ("nodes", cluster.nodes), ("gpu_mem_bytes", cluster.gpu_mem_bytes),
        ("seq_len", work.seq_len), ("micro_batch", work.micro_batch), ("grad_accum", work.grad_accum))
        if not isinstance(value, int) or isinstance(value, bool) or value < 1]
    if work.precision not in PRECISION_BYTES:
        problems.append(f"precision {work.precision!r}: expected one of {', '.join(PRECISION_BYTES)}")
    if work.expert_imbalance is not None and not work.expert_imbalance >= 1:
        problems.append(f"expert_imbalance {work.expert_imbalance}: the busiest rank's tokens over the mean is >= 1")
    if problems:
        raise ValueError("; ".join(problems))
