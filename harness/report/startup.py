"""The report's start-up section: per rank, the seconds and private memory of the model build and the engine
setup, the build beside the planner's bytes (summary.json "startup": profiling/startup.py, planner/load.py).

Memory is what the phase added above the rank's own private memory before it (RssAnon sampled during the
phase minus RssAnon at its start), so the interpreter and libraries do not count against the prediction.
"""

from __future__ import annotations


def startup_rows(run) -> list[dict]:
    startup = run.summary.get("startup") or {}
    predicted = startup.get("predicted_per_rank") or []
    rows = []
    for rank, records in enumerate(startup.get("per_rank", [])):
        row = {"rank": rank}
        for phase in ("build", "engine_setup"):
            r = records.get(phase) or {}
            row[f"{phase}_s"] = r.get("seconds")
            peak, before = r.get("peak_rss_anon_bytes"), r.get("rss_anon_before_bytes")
            row[f"{phase}_added_bytes"] = None if peak is None or before is None else peak - before
            row[f"{phase}_peak_rss_bytes"] = r.get("peak_rss_bytes")
        pred = predicted[rank] if rank < len(predicted) else None
        row["build_predicted_bytes"] = (pred or {}).get("build_bytes")
        rows.append(row)
    return rows


def startup_section(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    from harness.report.tables import fmt_bytes, fmt_ratio, ratio, table

    def secs(x) -> str:
        return "-" if x is None else f"{x:.2f}"

    return ["", "## Start-up per rank: model build and engine setup", "",
            "- added: private memory (RssAnon) the phase added at its peak; predicted: the planner's build bytes "
            "(owned tensors in the training dtype + the tensor being cast + the preset source)", "",
            table(["rank", "build s", "build added", "build predicted", "ratio", "build peak RSS", "engine setup s",
                    "engine setup added"],
                   [[str(r["rank"]), secs(r["build_s"]), fmt_bytes(r["build_added_bytes"]),
                     fmt_bytes(r["build_predicted_bytes"]),
                     fmt_ratio(ratio(r["build_added_bytes"], r["build_predicted_bytes"])),
                     fmt_bytes(r["build_peak_rss_bytes"]), secs(r["engine_setup_s"]),
                     fmt_bytes(r["engine_setup_added_bytes"])] for r in rows])]
