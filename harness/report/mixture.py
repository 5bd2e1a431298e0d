"""A mixture's sources in the report: weight, rows, epochs over the run, and the last per-source losses
(the `mixture` record the run writes at its start, and loss/<name>, rows/<name>, eval_loss/<name>)."""

from __future__ import annotations

from harness.report.tables import table


def _last(records: list[dict], key: str):
    return next((r[key] for r in reversed(records) if r.get(key) is not None), None)


def sources_section(run) -> list[str]:
    starts = [r for r in run.records if r.get("kind") == "mixture"]
    if not starts:
        return []
    start = starts[-1]  # the latest launch's (a resume writes its own)
    rows = []
    for src in start["sources"]:
        name = src["name"]
        read = sum(r.get(f"rows/{name}", 0) for r in run.train)
        loss, evals = _last(run.train, f"loss/{name}"), _last(run.eval, f"eval_loss/{name}")
        rows.append([name, f"{src['weight']:g}", f"{src['train_rows']:,} / {src['eval_rows']:,}", f"{read:,}",
                     f"{src['epochs']:.2f}", f"{loss:.4f}" if loss is not None else "-",
                     f"{evals:.4f}" if evals is not None else "-"])
    out = ["", "## Sources (train.datasets)", "",
           f"Blend period {start['period']} rows; {start['first_out']}.", ""]
    if start.get("note"):
        out += [f"Resumed: {start['note']}.", ""]
    return out + [table(["source", "weight", "train / eval rows", "rows read (logged steps)",
                         "epochs over the run", "last loss", "last eval loss"], rows)]
