"""Scale on paper: the recommended layout's predicted tokens/s per GPU against node count (weak scaling: the
global batch grows with the nodes, so each GPU keeps its micro-batch and accumulation)."""

from __future__ import annotations

from harness.planner import layouts, search


def node_counts(nodes: int) -> list[int]:
    top = max(64, 2 * nodes)
    out, n = [], 1
    while n <= top:
        out.append(n)
        n *= 2
    return sorted(set(out + [nodes]))


def curve(plan, model_cfg: dict, profile: dict) -> dict:
    """{"layout", "points": [{nodes, tokens_per_s_per_gpu, mfu, step_time_s, fits}]} for the recommended layout."""
    from harness.planner.params import count_params, model_shape

    r = plan.recommended
    c = layouts.candidate_of(r)
    count, shape = count_params(model_cfg), model_shape(model_cfg)
    w, given = plan.workload, plan.hardware
    per_gpu = r.get("global_batch", w.micro_batch * w.grad_accum * given.world) / given.world
    points = []
    for nodes in node_counts(given.nodes):
        cluster = given.with_nodes(nodes)
        if cluster.world % (c.tp * c.pp):
            continue
        work = w.but(global_batch=max(1, round(per_gpu * cluster.world)))
        dp = cluster.world // (c.tp * c.pp * c.sp)
        if work.global_batch % (dp * r.get("micro_batch", w.micro_batch)):
            continue
        lw = search.layout_work(work, r.get("micro_batch", w.micro_batch),
                                r.get("activation_checkpointing", w.activation_checkpointing), dp)
        t = search.timed(c, count, shape, cluster, lw, profile, plan.model["name"])
        points.append({"nodes": nodes, "tokens_per_s_per_gpu": t["time"]["tokens_per_s_per_gpu"],
                       "mfu": t["time"]["mfu"], "step_time_s": t["time"]["step_time_s"], "fits": t["fits"]})
    return {"layout": r["label"], "profile": profile["name"], "points": points}
