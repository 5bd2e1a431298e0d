"""The MoE section of report.md: tokens per expert per layer over the profiled steps and the imbalance (max / mean;
1.0 = every expert got as many tokens), from summary.json's "experts" (harness/profiling/experts.py)."""

from __future__ import annotations

from harness.report.tables import table


def experts_section(run) -> list[str]:
    experts = run.summary.get("experts")
    if not experts:
        return []
    tokens, ratio = experts["tokens_per_layer"], experts["imbalance_per_layer"]
    rows = [[layer, " / ".join(str(n) for n in tokens[layer]), f"{ratio[layer]:.2f}"] for layer in tokens]
    return ["", "## Expert load on profiled steps (tokens per expert, all ranks)", "",
            table(["router", "tokens per expert", "imbalance (max / mean)"], rows)]
