"""The report's pipeline section: per rank, its stage, p2p and tensor-parallel bytes, and the bubble.

Reads summary.json's "pipeline" block (profiling/pipe.py) and the per-rank comm predictions and breakdown by
group (dp, pp, tp, tied; planner/rank.py). The bubble is not flagged: the planner's (p-1)/(m+p-1)
assumes equal stages and free communication, so the measured idle share is set beside it for reading, and
on a shared CPU it also carries scheduling noise. A planned layer split that differs from the engine's is
flagged: every per-stage number rests on it.
"""

from __future__ import annotations


def _fmt(n) -> str:
    from harness.report.tables import fmt_bytes

    return fmt_bytes(n)


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def pipeline_rows(run) -> list[dict]:
    pipe = run.summary.get("pipeline") or {}
    if not pipe:
        return []
    comm = run.summary.get("comm", {})
    measured = comm.get("measured_per_rank", [])
    groups = comm.get("predicted_by_group_per_rank", [])
    rows = []
    for rank, stage in enumerate(pipe.get("stage_per_rank", [])):
        got = measured[rank] if rank < len(measured) else {}
        by_group = groups[rank] if rank < len(groups) else {}
        p2p = by_group.get("pp", {})
        rows.append({"rank": rank, "stage": stage,
                     "send_predicted": p2p.get("send"), "send_measured": got.get("send"),
                     "recv_predicted": p2p.get("recv"), "recv_measured": got.get("recv"),
                     "tp_all_reduce_predicted": by_group.get("tp", {}).get("all_reduce"),
                     "tied_all_reduce_predicted": by_group.get("tied", {}).get("all_reduce"),
                     "bubble_predicted": pipe.get("predicted_bubble"),
                     "bubble_measured": (pipe.get("measured_bubble_per_rank") or [None] * (rank + 1))[rank]})
    return rows


def pipeline_flags(run) -> list[str]:
    pipe = run.summary.get("pipeline") or {}
    planned, engine = pipe.get("parts_planned"), pipe.get("parts_engine")
    if planned and engine and planned != engine:
        return [f"pipeline: the planner split the layers {planned}, the engine {engine}: per-stage predictions "
                "rest on the planner's split"]
    return []


def pipeline_section(run, rows: list[dict]) -> list[str]:
    if not rows:
        return []
    from harness.report.tables import table

    pipe = run.summary["pipeline"]
    out = ["", "## Pipeline stages per rank (predicted vs measured)", "",
           f"- {pipe.get('pp')} stages, {pipe.get('micro_batches')} micro-batches per step; layer split "
           f"planned {pipe.get('parts_planned')}, engine {pipe.get('parts_engine')}",
           f"- bubble (p-1)/(m+p-1) = {_pct(pipe.get('predicted_bubble'))} predicted; measured: the share of each "
           "rank's schedule not spent in forward/backward (waiting on neighbours, p2p copies, loading batches)", "",
           table(["rank", "stage", "send predicted", "send measured", "recv predicted", "recv measured",
                   "tp all-reduce (predicted part)", "tied all-reduce (predicted part)", "bubble predicted",
                   "bubble measured"],
                  [[str(r["rank"]), str(r["stage"]), _fmt(r["send_predicted"]), _fmt(r["send_measured"]),
                    _fmt(r["recv_predicted"]), _fmt(r["recv_measured"]), _fmt(r["tp_all_reduce_predicted"]),
                    _fmt(r["tied_all_reduce_predicted"]), _pct(r["bubble_predicted"]), _pct(r["bubble_measured"])]
                   for r in rows])]
    return out
