"""The report's step-time section: the time model's prediction for this run beside each rank's measured median
step time (after the warm-up step), and the predicted breakdown beside DeepSpeed's own timers."""

from __future__ import annotations

from harness.report.tables import table


def step_time_section(run) -> list[str]:
    st = run.summary.get("throughput", {}).get("step_time")
    if not st:
        return []
    out = ["", "## Step time (predicted vs measured)", ""]
    if "step_time_s" not in st:
        return out + [f"not predicted: {st.get('note', 'no hardware profile')}"]
    measured = st.get("measured_median_s_per_rank") or []
    ratio = lambda m: f"{m / st['step_time_s']:.2f}" if m else "-"  # noqa: E731
    out.append(f"profile **{st['profile']}** ({st['profile_source']}); the step is synchronous, so every rank is "
               "predicted the same time (the slowest stage's, with a pipeline)")
    out += ["", table(["rank", "measured median s", "predicted s", "measured / predicted"],
                       [[str(i), f"{m:.3f}" if m else "-", f"{st['step_time_s']:.3f}", ratio(m)]
                        for i, m in enumerate(measured)])]
    terms = {k.removesuffix("_s"): v for k, v in st["breakdown"].items() if v}
    out += ["", "predicted breakdown (s per step; communication: the exposed part only):", "",
            table(list(terms), [[f"{v:.4f}" for v in terms.values()]])]
    stages = st.get("per_stage") or []
    if stages:
        pp = len(stages)
        out += ["", "per pipeline stage (ranks are laid out tensor fastest, then data, then pipeline: stage = rank // "
                f"{max(1, len(measured) // pp)}), predicted s per step:", "",
                table(["stage", "compute s", "waiting s", "busy"],
                       [[str(s["stage"]), f"{s['compute_s']:.3f}", f"{s['idle_s']:.3f}", f"{s['busy']:.0%}"]
                        for s in stages])]
    return out
