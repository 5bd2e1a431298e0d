"""Search the layouts that fit and rank them by predicted tokens/s (steptime.py), and evaluate one given layout.

Knobs searched: the strategies of the decision order (layouts.candidates: ZeRO-0..3, optimizer/parameter offload
to CPU or NVMe, tensor parallel inside a node with ZeRO-1..3, pipelines across nodes with tensor parallel inside and
ZeRO-1 over the replicas), activation checkpointing off/on, and the micro-batch: every divisor of the
per-replica batch (global batch / data-parallel size) that fits, since a pipeline may prefer more, smaller
micro-batches (a smaller bubble) while the other layouts gain nothing from them. The global batch is fixed,
so every layout trains the same tokens per step and tokens/s compare like for like.
"""

from __future__ import annotations

from harness.planner.optimizer import offers_rung
from harness.planner import launch_lines, layouts, longest, steptime
from harness.planner.inputs import Cluster, Workload
from harness.planner.shape import ModelShape

MAX_MICRO_BATCH = 64
TOP = 5
# The first fit in the decision order stays the recommendation unless the fastest layout beats it by more than this: the
# model's own error (tests/test_published_runs.py holds it to 15 %) is larger than a few per cent, and the
# first fit is the simpler layout.
KEEP_FIRST_FIT_WITHIN = 0.05


def divisors(n: int, limit: int = MAX_MICRO_BATCH) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def layout_work(work: Workload, micro_batch: int, ac: bool, dp: int) -> Workload:
    return work.but(micro_batch=micro_batch, activation_checkpointing=ac,
                grad_accum=work.global_batch // (dp * micro_batch))


def timed(c, count, shape: ModelShape, cluster: Cluster, work: Workload, profile: dict, model_name: str) -> dict:
    """layouts.evaluate plus the predicted step time, the batch split and the launch line of this layout."""
    result = layouts.evaluate(c, count, shape, cluster, work)
    result["time"] = steptime.step_time(c, count, shape, profile, cluster, work, result)
    result["micro_batch"], result["activation_checkpointing"] = work.micro_batch, c.checkpointing(work)
    result["global_batch"] = work.global_batch
    longest.attach(result, count, shape, cluster, work)
    result["overrides"] = layouts.overrides(c, result, work)
    result["launch"] = launch_lines.launch_command(c.recipe, model_name, cluster, result["overrides"])
    result.update(launch_lines.cluster_commands(c.recipe, model_name, cluster, result["overrides"]))
    return result


def _best_for(c, count, shape: ModelShape, cluster: Cluster, work: Workload, profile: dict,
              model_name: str) -> list[dict]:
    """The fastest fitting micro-batch of candidate `c`, with and without checkpointing."""
    dp = cluster.world // (c.tp * c.pp * c.sp)  # data-parallel replicas: each sequence spans sp ranks
    if work.global_batch % dp:
        return []
    sizes = divisors(work.global_batch // dp)
    out = []
    for ac in ((True,) if c.act else (False, True)):
        best = None
        for mb in reversed(sizes):  # memory grows with the micro-batch: the first that fits is the largest
            lw = layout_work(work, mb, ac, dp)
            if c.pp > 1 and lw.grad_accum < c.pp:
                continue  # fewer micro-batches than stages: the pipeline idles most of the step
            r = layouts.evaluate(c, count, shape, cluster, lw)
            if not r["applicable"]:
                return out
            if not r["fits"]:
                continue
            r = timed(c, count, shape, cluster, lw, profile, model_name)
            if best is None or r["time"]["tokens_per_s"] > best["time"]["tokens_per_s"]:
                best = r
            if c.pp == 1:
                break  # without a pipeline a smaller micro-batch only adds per-call overheads
        if best:
            out.append(best)
    return out


def search(count, shape: ModelShape, cluster: Cluster, work: Workload, profile: dict, model_name: str) -> list[dict]:
    """Every fitting layout (best micro-batch per strategy and checkpointing), fastest first."""
    found = []
    for c in layouts.candidates(cluster.world, cluster.gpus_per_node, count.num_layers, shape,
                                work.activation_offload, num_experts=count.num_experts,
                                nvme=cluster.nvme_bytes is not None, bf16_states_rung=offers_rung(work)):
        found += _best_for(c, count, shape, cluster, work, profile, model_name)
    return sorted(found, key=lambda r: -r["time"]["tokens_per_s"])


def why_faster(fast: dict, slow: dict) -> str:
    """The breakdown terms that make `slow` slower than `fast`, largest first, in words."""
    a, b = fast["time"]["breakdown"], slow["time"]["breakdown"]
    deltas = sorted(((b[k] - a[k], k) for k in a), reverse=True)
    parts = [f"{k.removesuffix('_s').replace('_', ' ')} {b[k]:.2f} s vs {a[k]:.2f} s" for d, k in deltas[:3]
             if d > 0.02 * slow["time"]["step_time_s"]]
    return "; ".join(parts) or "the two differ by less than 2 % in every term"


def compare(fastest: dict, first_fit: dict) -> dict:
    ratio = fastest["time"]["tokens_per_s"] / first_fit["time"]["tokens_per_s"]
    return {"first_fit": first_fit["label"], "fastest": fastest["label"], "speedup": ratio,
            "why": why_faster(fastest, first_fit)}


def candidate_for(zero: int, offload: str, tp: int, pp: int, ep: int = 1) -> "layouts.Candidate":
    """The harness recipe that runs this layout (--zero/--offload/--tp/--pp/--ep), refused when none can."""
    from harness.errors import UsageError

    if ep > 1:
        if tp > 1 or pp > 1 or offload != "none" or zero not in (1, 2):
            raise UsageError(f"--ep {ep} with --zero {zero} --tp {tp} --pp {pp} --offload {offload}: the planner times "
                             "expert parallelism (DeepSpeed AutoEP) on ZeRO-1 or 2 without tp, pipeline or offload "
                             "(AutoEP refuses tensor parallel); use --zero 1 or 2 alone with --ep")
        return layouts.Candidate(f"zero{zero}", zero, ep=ep)
    if offload != "none" and (zero < 2 or tp > 1 or pp > 1):
        raise UsageError(f"--offload {offload} needs --zero 2 or 3 without --tp/--pp (got --zero {zero}, --tp {tp}, "
                         f"--pp {pp}): DeepSpeed offloads ZeRO-2/3 states; the harness's tp and pipeline recipes "
                         "keep them on the GPUs")
    if offload == "nvme" and zero != 3:
        raise UsageError("--offload nvme needs --zero 3 (ZeRO-Infinity); ZeRO-2 treats nvme as cpu")
    if pp > 1:
        if zero > 1:
            raise UsageError(f"--pp {pp} with --zero {zero}: DeepSpeed's pipeline engine runs ZeRO-0 or 1 only")
        return layouts.Candidate("3d" if tp > 1 else "pipeline", zero, tp=tp, pp=pp)
    if tp > 1:
        return layouts.Candidate("tp", zero, tp=tp)
    if offload == "cpu":
        return layouts.Candidate(f"zero{zero}_offload", zero, "cpu", "cpu" if zero == 3 else "none")
    if offload == "nvme":
        return layouts.Candidate("zero3_nvme", 3, "nvme", "nvme")
    return layouts.Candidate("ddp" if zero == 0 else f"zero{zero}", zero)


def evaluate_layout(layout: dict, count, shape: ModelShape, cluster: Cluster, work: Workload, profile: dict,
                    model_name: str) -> dict:
    """One layout given exactly: memory, verdict and step time; evaluated even when it does not fit."""
    from harness.errors import UsageError

    c = candidate_for(layout["zero"], layout["offload"], layout["tp"], layout["pp"], layout.get("ep", 1))
    from harness.planner.moe import ep_problem

    problem = ep_problem(shape.model_type, shape.num_experts, c.ep, cluster.world)
    if problem:
        raise UsageError(f"--ep {c.ep}: {problem}")
    if cluster.world % (c.tp * c.pp):
        raise UsageError(f"--tp {c.tp} x --pp {c.pp} = {c.tp * c.pp} does not divide {cluster.world} GPUs "
                         f"({cluster.nodes} nodes x {cluster.gpus_per_node})")
    if c.tp > cluster.gpus_per_node or cluster.gpus_per_node % c.tp:
        raise UsageError(f"--tp {c.tp}: tensor parallel stays inside a node of {cluster.gpus_per_node} GPUs; "
                         "use a degree that divides it")
    if c.pp > count.num_layers:
        raise UsageError(f"--pp {c.pp} > the model's {count.num_layers} blocks")
    dp = cluster.world // (c.tp * c.pp)
    per_replica, mb = work.global_batch / dp, work.micro_batch
    if per_replica != int(per_replica) or int(per_replica) % mb:
        raise UsageError(f"--global-batch {work.global_batch} over {dp} data-parallel replicas is "
                         f"{per_replica:g} sequences each, not a multiple of --micro-batch {mb}: give a global batch "
                         f"that is a multiple of {dp * mb} (data parallel {dp} x micro-batch {mb})")
    r = timed(c, count, shape, cluster, layout_work(work, mb, work.activation_checkpointing, dp), profile, model_name)
    r["time"]["fits"] = r["fits"]
    return r


def _layout_note(plan, result: dict | None) -> None:
    """The timed layout's own note (ZeRO-3 Muon's idle ranks, layouts._comm), once, beside decide.notes'."""
    if result and (note := result["comm"].get("muon_note")) and note not in plan.notes:
        plan.notes.append(note)


def attach(plan, count, shape: ModelShape, cluster: Cluster, work: Workload, profile: dict,
           layout: dict | None) -> None:
    """Add the step-time model's view to a Plan: the ranked layouts, the fastest as the recommendation, the
    first fit in the decision order timed at the same global batch with the speed ratio, or one evaluated layout."""
    name = plan.model["name"]
    gb = work.global_batch or work.micro_batch * work.grad_accum * cluster.world
    base = work.but(global_batch=gb)
    plan.workload = plan.workload.but(global_batch=gb)
    plan.profile = {k: profile[k] for k in ("name", "description", "device", "gemm_efficiency", "source")
                    if k in profile}
    if layout:
        plan.evaluated = evaluate_layout(layout, count, shape, cluster, base, profile, name)
        _layout_note(plan, plan.evaluated)
        return
    plan.ranked = search(count, shape, cluster, base, profile, name)
    first = plan.recommended
    if first is not None:
        c = layouts.candidate_of(first)
        dp = first["dp"] // c.sp  # a result's "dp" is ZeRO's group (replicas x sp): the replicas
        if gb % (dp * work.micro_batch) == 0:
            plan.first_fit = timed(c, count, shape, cluster, layout_work(base, work.micro_batch,
                                                                     work.activation_checkpointing, dp),
                                   profile, name)
    if plan.ranked:  # a bf16-states layout costs loss (planner/optimizer.py): never picked on speed over an exact one
        fastest = next((r for r in plan.ranked if not r.get("states")), plan.ranked[0])
        plan.recommended = fastest
        if plan.first_fit:
            plan.comparison = compare(fastest, plan.first_fit)
            if plan.comparison["speedup"] <= 1 + KEEP_FIRST_FIT_WITHIN:
                plan.recommended = plan.first_fit
                plan.comparison["kept_first_fit"] = True
    _layout_note(plan, plan.recommended)  # the recommendation may have changed: its note follows it
