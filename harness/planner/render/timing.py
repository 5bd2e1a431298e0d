"""The step-time part of a plan as text: the fastest layouts, the first fit in the decision order beside them,
one evaluated layout. Times in seconds per optimizer step; tokens/s per GPU and MFU (model FLOPs, no recompute)
over the profile's dense peak."""

from __future__ import annotations

from harness.planner.layouts import gb

SHORT = {"forward_s": "fwd", "backward_s": "bwd", "recompute_s": "recompute", "tp_comm_s": "tp", "sp_a2a_s": "sp-a2a",
         "activation_offload_s": "act-offload",
         "bubble_s": "bubble", "p2p_s": "p2p", "dp_reduce_exposed_s": "dp-reduce", "dp_gather_exposed_s": "dp-gather",
         "tied_embedding_s": "tied", "optimizer_s": "optimizer", "zero_hooks_s": "zero-hooks", "offload_pcie_s": "pcie", "nvme_s": "nvme",
         "all_to_all_s": "all-to-all", "expert_imbalance_s": "imbalance", "reference_s": "ref-fwd",
         "teacher_s": "teacher-fwd", "muon_gather_s": "muon-gather"}


def breakdown_text(t: dict) -> str:
    return " ".join(f"{SHORT[k]} {v:.3g}" for k, v in t["breakdown"].items() if v > 0.005 * t["step_time_s"])


def layout_line(i: int | str, r: dict, width: int = 32) -> str:
    t = r["time"]
    ckpt = "full" if r["activation_checkpointing"] else "none"
    return (f"  {i:>2}  {r['label']:<{width}}{ckpt:<6}{r['micro_batch']:>5}{r['micro_batches']:>6}"
            f"{gb(r['memory']['gpu_bytes']):>10}{seq_text(r.get('max_seq_len')):>9}{t['step_time_s']:>9.3g}"
            f"{t['tokens_per_s_per_gpu']:>10.0f}"
            f"{t['mfu']:>7.1%}  {breakdown_text(t)}")


def head(width: int = 32) -> str:
    return (f"  {'#':>2}  {'layout':<{width}}{'ckpt':<6}{'micro':>5}{'accum':>6}{'GPU/rank':>10}{'max seq':>9}"
            f"{'step s':>9}{'tok/s/GPU':>10}{'MFU':>7}  breakdown (s; exposed comm only)")


def seq_text(tokens: int | None) -> str:
    """The longest seq_len a layout holds, short: 30.5K, 4.17M ('-' when none)."""
    if not tokens:
        return "-"
    for unit, scale in (("M", 1e6), ("K", 1e3)):
        if tokens >= scale:
            return f"{tokens / scale:.3g}{unit}"
    return str(tokens)


def profile_line(plan) -> str:
    p, w = plan.profile, plan.workload
    pairs = {"pairs": f" pairs x {w.rows_per_item}", "rollouts": " completions",  # a pair is two sequences
             "distill": " completions"}.get(w.terms, "")
    return (f"time      hardware profile {p['name']} (gemm efficiency {p['gemm_efficiency']:.2f}; --hardware NAME|FILE, "
            f"`harness calibrate`); global batch {w.global_batch}{pairs} x {w.seq_len} = "
            f"{w.global_batch * w.rows_per_item * w.seq_len:,} tokens per step")


def ranking(plan, top: int = 5) -> list[str]:
    if not plan.ranked:
        return []
    shown = plan.ranked[:top] + ([plan.first_fit] if plan.first_fit else [])
    w = max([32] + [len(r["label"]) + 1 for r in shown])  # the offloaded long-context labels are longer
    lines = [f"fastest layouts that fit ({len(plan.ranked)} fit; --json lists all):", head(w)]
    lines += [layout_line(i, r, w) for i, r in enumerate(plan.ranked[:top], 1)]
    if plan.first_fit:
        lines.append(layout_line("ff", plan.first_fit, w) + "   <- first fit in the decision order")
    cmp = plan.comparison
    if cmp:
        if cmp["fastest"] == cmp["first_fit"]:
            lines.append(f"the first fit in the decision order ({cmp['first_fit']}) is also the fastest predicted "
                         "layout")
        elif cmp.get("kept_first_fit"):
            lines.append(f"recommending the first fit in the decision order ({cmp['first_fit']}): {cmp['fastest']} "
                         "is predicted only "
                         f"{cmp['speedup']:.2f}x faster, inside the model's error ({cmp['why']})")
        else:
            lines.append(f"predicted speed-up of {cmp['fastest']} over the first fit in the decision order "
                         f"({cmp['first_fit']}): "
                         f"{cmp['speedup']:.2f}x ({cmp['why']})")
    return lines


def evaluated(plan) -> list[str]:
    r = plan.evaluated
    verdict = "fits" if r["fits"] else f"DOES NOT FIT ({r['why_not']})"
    w = max(32, len(r["label"]) + 1)
    return [f"evaluated layout (dp {r['dp']} x tp {r['tp']} x pp {r['pp']}): {verdict}", head(w), layout_line("", r, w),
            *launch_lines(r)]


def launch_lines(r: dict) -> list[str]:
    """The launch command, and the same run under Slurm and on Ray (docs/cluster.md)."""
    return [f"  launch: {r['launch']}", f"  slurm:  {r['slurm']}", f"  ray:    {r['ray']}", f"  k8s:    {r['k8s']}"]
