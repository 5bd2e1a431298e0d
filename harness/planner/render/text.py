"""A plan as text (what a person reads before renting hardware) and as JSON (the same, as data).

Units are explicit: GB = 10^9 bytes (how GPUs and RAM are sold), GiB = 2^30 bytes (what nvidia-smi and
DeepSpeed's "GB" print); the breakdown shows both.
"""

from __future__ import annotations

import json

from harness.planner.decide import Plan
from harness.planner.inputs import Cluster
from harness.planner.layouts import gb
from harness.planner.memory import TERMS
from harness.planner.render import objective

GIB = 2**30
TERM_NOTES = {
    "params": "weights in training precision", "grads": "gradients", "fp32_master": "fp32 master weights",
    "optimizer_moments": "optimizer state (Adam: m and v)", "fp32_grads": "fp32 gradient partition",
    "reduce_buckets": "gradient reduce buckets", "gathered_params": "ZeRO-3 gathered layer + prefetch",
    "offload_buffers": "pinned staging / swap buffers",
}
REFERENCE_NOTES = {"engine": "frozen 16-bit weights", "precomputed": "log-probs on the host", "adapter": "no copy"}


def gb_gib(nbytes: float) -> str:
    return f"{nbytes / 1e9:9.2f} GB {nbytes / GIB:9.2f} GiB"


def to_json(plan: Plan) -> str:
    return json.dumps(plan.to_dict(), indent=2, sort_keys=False)


def _header(plan: Plan) -> list[str]:
    m, cluster, w, seed = plan.model, plan.hardware, plan.workload, plan.seed
    p, s = m["params"], m["shape"]
    cpu = f"{gb(cluster.cpu_mem_bytes)} per node" if cluster.cpu_mem_bytes else "not given (offload not checked)"
    nvme = f"{gb(cluster.nvme_bytes)} per node" if cluster.nvme_bytes else "none"
    nodes = f"{cluster.nodes} node{'s' if cluster.nodes > 1 else ''} x {cluster.gpus_per_node} GPU = {cluster.world}"
    return [
        f"model     {m['name']}: {p['total'] / 1e9:.2f} B params ({p['total']:,}; {p['method']}), "
        f"{s['num_hidden_layers']} layers, hidden {s['hidden_size']}, heads {s['num_attention_heads']}"
        f"/{s['num_key_value_heads']} kv, vocab {s['vocab_size']}",
        f"hardware  {nodes}, {gb(cluster.gpu_mem_bytes)} ({cluster.gpu_mem_bytes / GIB:.1f} GiB) per GPU, "
        f"{gb(cluster.usable_gpu_bytes)} usable ({cluster.reserve_fraction:.0%} reserve); CPU RAM {cpu}; NVMe {nvme}",
        f"workload  micro batch {w.micro_batch} x {w.seq_len} tokens, {w.precision}, activation "
        f"checkpointing {'on' if w.activation_checkpointing else 'off'}, grad accum {w.grad_accum}"
        + ("" if w.optimizer_states == 2 else f", optimizer state {w.optimizer_states} x fp32 per parameter")
        + _widths(w, p),
        *objective.headline(w),
        *([f"experts   {p['num_experts']} routed per sparse block, top {p['top_k']}, {p['moe_layers']} sparse "
           f"blocks: {p['total'] / 1e9:.2f} B total, {p['active'] / 1e9:.2f} B active per token; step time and "
           "MFU on active parameters"] if p.get("num_experts") else []),
        f"seed rule 16 B/param (model states only): DP {gb(seed['dp_bytes_per_gpu'])} per GPU; "
        f"ZeRO-3 over {seed['world']} GPUs {gb(seed['zero3_bytes_per_gpu'])} per GPU",
    ]


def _widths(w, p: dict) -> str:
    """The optimizer's widths when they are not fp32 Adam's (docs/optimizers.md)."""
    d = w.optimizer_dtypes
    parts = [f"Muon on {p['muon_params'] / p['total']:.0%} of the parameters (1 state), AdamW on the rest"
             ] if d.muon and p.get("muon_params") else []
    parts += [f"{name} bf16" for name, width in (("master weights", d.master_bytes), ("optimizer states",
                                                                                    d.state_bytes)) if width == 2]
    return "".join(f", {part}" for part in parts)


def _breakdown(r: dict, cluster: Cluster) -> list[str]:
    mem = r["memory"]
    lines = ["  per GPU, each term at its peak (what DeepSpeed 0.19.8 allocates)"]
    for term in TERMS:
        nbytes = mem["model_states"][term]["gpu"]
        if nbytes:
            lines.append(f"    {term:<18} {TERM_NOTES[term]:<34}{gb_gib(nbytes)}")
    ref = mem.get("reference")
    if ref and ref["mode"]:
        used = ref["modes"][ref["mode"]]["gpu"]
        lines.append(f"    {'reference':<18} {ref['mode'] + ': ' + REFERENCE_NOTES[ref['mode']]:<34}{gb_gib(used)}")
    lines += objective.breakdown_line(mem, 34, gb_gib)
    acts = mem["activations"]
    lines.append(f"    {'activations':<18} {'blocks + recompute + logits':<34}{gb_gib(acts['total'])}")
    parts = [(k, acts.get(k, 0)) for k in ("layers", "recompute", "mlp_tile", "logits", "mask", "vision_saved",
                                          "vision_transient")]
    lines.append(f"      {acts.get('tokens_per_rank', 0):,} tokens per rank: "
                 + ", ".join(f"{k.replace('_', ' ')} {gb(v)}" for k, v in parts if v))
    lines.append(f"    {'in backward':<18} {'model states + activations':<34}{gb_gib(mem['gpu_backward_bytes'])}")
    lines.append(f"    {'in the step':<18} {'model states (activations freed)':<34}{gb_gib(mem['gpu_step_bytes'])}")
    lines.append(f"    {'peak':<18} {'the larger, of ' + gb(cluster.usable_gpu_bytes) + ' usable':<34}"
                 f"{gb_gib(mem['gpu_bytes'])}")
    seed = mem["seed_model_states"]
    lines.append(f"    {'(seed rule)':<18} {'16 B/param model states':<34}{gb_gib(seed['gpu'])}")
    for device, key in (("cpu", "cpu_bytes_per_node"), ("nvme", "nvme_bytes_per_node")):
        if mem[key]:
            terms = ", ".join(f"{t} {gb(mem['model_states'][t][device])}" for t in TERMS
                              if mem["model_states"][t][device])
            if device == "cpu" and acts.get("cpu_offload"):
                terms += f"{', ' if terms else ''}checkpointed activations {gb(acts['cpu_offload'])}"
            if ref and ref["mode"] and ref["modes"][ref["mode"]][device]:
                terms += f"{', ' if terms else ''}{ref['mode']} reference {gb(ref['modes'][ref['mode']][device])}"
            lines.append(f"  {device.upper()} per node: {gb(mem[key])} ({gb(mem[key] / cluster.gpus_per_node)}"
                         f" per rank: {terms})")
    teacher = mem.get("teacher")
    return (lines + (_reference(ref, r, cluster) if ref else [])
            + (objective.teacher_lines(teacher, r.get("time", {})) if teacher else []))


def _reference(ref: dict, r: dict, cluster: Cluster) -> list[str]:
    """Every reference mode's bytes per rank and time, the one used and the one recommended (planner/reference.py)."""
    if not ref["mode"]:
        return [f"  reference: none ({ref['why']})"]
    rec = "" if ref["recommended"] == ref["mode"] else f"; recommended: {ref['recommended']}"
    lines = [f"  reference ({ref['objective']}): {ref['mode']}{rec}: {ref['why']}",
             f"    {'mode':<12}{'GPU/rank':>10}{'CPU/rank':>10}{'NVMe/rank':>10}  fits  time"]
    time = r.get("time", {})
    for mode, b in ref["modes"].items():
        verdict = "n/a" if not b["applicable"] else "yes" if b["fits"] else "no"
        lines.append(f"    {mode:<12}{gb(b['gpu']) if b['gpu'] else '-':>10}{gb(b['cpu']) if b['cpu'] else '-':>10}"
                     f"{gb(b['nvme']) if b['nvme'] else '-':>10}  {verdict:<6}{_mode_time(mode, ref, time)}")
    return lines


def _mode_time(mode: str, ref: dict, time: dict) -> str:
    if mode == "precomputed":
        per = f"{ref['bytes_per_pair']} B per pair on every rank's host"
        took = time.get("reference_pass_s")
        return per + (f"; one pass up front: {took:,.0f} s" if took is not None else "; one pass up front")
    fwd = time.get("breakdown", {}).get("forward_s")
    step = f": {fwd:.3g} s per step" if fwd is not None else ""
    return f"one more forward per micro-step{step}" + (" (the base, adapters off)" if mode == "adapter" else "")


def _comm(r: dict) -> list[str]:
    lines = ["  traffic per optimizer step, per rank      logged (comms logger)      on the wire (ring)"]
    for row in r["comm"]["rows"]:
        name = f"{row['group']}({row['group_size']}) {row['collective']}"
        lines.append(f"    {name:<36}{gb(row['logged_bytes']):>14}{gb(row['wire_bytes']):>24}")
    if not r["comm"]["rows"]:
        lines.append("    none (one rank)")
    if r["pp"] > 1:
        lines.append(f"  pipeline bubble (p-1)/(m+p-1) = ({r['pp']}-1)/({r['micro_batches']}+{r['pp']}-1) "
                     f"= {r['bubble_fraction']:.1%}")
        stages = ", ".join(f"{s['stage']}: layers {s['layers'][0]}-{s['layers'][1] - 1} ({s['blocks']} blocks, "
                           f"{s['params'] / 1e9:.2f} B params)" for s in r.get("stages", []))
        lines.append(f"  stages (DeepSpeed's 'parameters' partition; memory above is the largest): {stages}")
    return lines


def _table(plan: Plan) -> list[str]:
    from harness.planner.render import timing

    first = next((r for r in plan.candidates if r["fits"]), None)
    last = plan.candidates.index(first) if first else len(plan.candidates) - 1
    w = max([30] + [len(r["label"]) + 1 for r in plan.candidates[:last + 1]])  # the offloaded long-context labels
    head = f"  {'#':>2}  {'strategy':<{w}}{'fits':<5}{'GPU/rank':>10}{'CPU/node':>10}{'NVMe/node':>10}" \
           f"{'wire/step':>11}{'max seq':>9}  why not"
    lines = ["decision order (GB = 10^9 bytes, GiB = 2^30 bytes; max seq: the longest seq_len each holds):", head]
    for i, r in enumerate(plan.candidates[:last + 1], 1):
        mem = r["memory"]
        cells = [gb(mem["gpu_bytes"]), gb(mem["cpu_bytes_per_node"]) if mem["cpu_bytes_per_node"] else "-",
                 gb(mem["nvme_bytes_per_node"]) if mem["nvme_bytes_per_node"] else "-"]
        verdict = "yes" if r["fits"] else ("n/a" if not r["applicable"] else "no")
        why = r["why_not"] or ("<- recommended" if r is plan.recommended else "<- first fit in the decision order")
        lines.append(f"  {i:>2}  {r['label']:<{w}}{verdict:<5}{cells[0]:>10}{cells[1]:>10}{cells[2]:>10}"
                     f"{gb(r['comm']['wire_bytes']) if r['comm']['wire_bytes'] else '-':>11}"
                     f"{timing.seq_text(r.get('max_seq_len')):>9}  {why}")
    if first and first.get("states_cost"):
        lines.append(f"  {first['label']}: {first['states_cost']}")
    if last + 1 < len(plan.candidates):
        lines.append(f"  ({len(plan.candidates) - last - 1} costlier options also evaluated: --json lists them)")
    top = max(plan.candidates, key=lambda r: r.get("max_seq_len", 0))
    if top.get("max_seq_len"):
        lines.append(f"  longest sequence of any layout: {top['label']} holds {top['max_seq_len']:,} tokens "
                     f"({timing.seq_text(top['max_seq_len'])}) at micro-batch {plan.workload.micro_batch}")
    return lines


def to_text(plan: Plan) -> str:
    from harness.planner.render import timing

    lines = _header(plan) + ([timing.profile_line(plan)] if plan.profile else [])
    lines += [f"note      {n}" for n in plan.notes] + [""]
    if plan.evaluated:
        return "\n".join(lines + timing.evaluated(plan) + [""] + _breakdown(plan.evaluated, plan.hardware)
                         + _comm(plan.evaluated)) + "\n"
    r = plan.recommended
    if r:
        label = f" ({r['label']})" if r["label"] != r["recipe"] else ""
        why = "the first option in the decision order that fits"
        if "time" in r and not (plan.comparison or {}).get("kept_first_fit"):
            why = "the fastest predicted layout that fits"
        elif "time" in r:
            why += " (and within 5 % of the fastest predicted)"
        lines.append(f"recommended: {r['recipe']}{label}: {why}")
        from harness.planner.render.timing import launch_lines

        lines += launch_lines(r)
        lines.append("  overrides: " + ", ".join(f"{k}={v}" for k, v in r["overrides"].items()))
        if r.get("states_cost"):
            lines.append(f"  cost: {r['states_cost']}")
        lines += _breakdown(r, plan.hardware) + _comm(r)
        lines += [""] + timing.ranking(plan) if plan.ranked else []
    else:
        lines.append("no strategy fits:")
        lines += [f"  {line}" for line in plan.missing]
    return "\n".join(lines + [""] + _table(plan)) + "\n"

