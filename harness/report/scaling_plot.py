"""`harness plan --scaling PNG`: predicted tokens/s per GPU against node count, drawn like the report's plots."""

from __future__ import annotations

from pathlib import Path

from harness.report.plots import _pyplot, _save


def draw(scaling: dict, path: str) -> str:
    """Write the PNG; a point whose layout does not fit in memory is drawn hollow."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    pts = scaling["points"]
    ax.plot([p["nodes"] for p in pts], [p["tokens_per_s_per_gpu"] for p in pts], "-", color="#4c72b0",
            label=f"{scaling['layout']} on {scaling['profile']}")
    for p in pts:
        ax.plot(p["nodes"], p["tokens_per_s_per_gpu"], "o", color="#4c72b0",
                markerfacecolor="#4c72b0" if p["fits"] else "white")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("nodes")
    ax.set_ylabel("predicted tokens/s per GPU")
    ax.set_title("weak scaling (hollow: does not fit in memory)")
    ax.set_ylim(bottom=0)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    _save(fig, out, [ax])
    return str(out)
