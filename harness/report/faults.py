"""The report's numeric faults: a headline line and a table of the steps train.on_nonfinite dropped (skipped, rolled
back, or the one the run stopped at), from the `fault` and `rollback` records of metrics.jsonl
(harness/train/faults.py)."""

from __future__ import annotations

from harness.report.tables import table


def _faults(records: list[dict]) -> list[dict]:
    return [r for r in records if r.get("kind") == "fault"]


def faults_line(records: list[dict]) -> list[str]:
    faults = _faults(records)
    if not faults:
        return []
    words = {"skip": "skipped", "rollback": "rolled back", "stop": "stopped the run"}
    said = ", ".join(f"{n} {w}" for a, w in words.items() if (n := sum(f["action"] == a for f in faults)))
    return [f"- numeric faults: {len(faults)} step{'s' if len(faults) != 1 else ''} dropped ({said}; "
            "train.on_nonfinite)"]


def _cell(x) -> str:
    return "-" if x is None else x if isinstance(x, str) else f"{x:.4g}"


def faults_section(records: list[dict]) -> list[str]:
    faults = _faults(records)
    if not faults:
        return []
    backs = [r for r in records if r.get("kind") == "rollback"]
    rows = []
    for f in faults:
        action = {"skip": "skipped", "stop": "stopped the run"}.get(f["action"], f["action"])
        if f["action"] == "rollback":
            to = next((b for b in backs if b.get("skipped_batch") == f["batch"]), None)
            action = f"rolled back to {to['tag']}" if to else "rolled back"
        why = "loss spike" if f["reason"] == "spike" else f"non-finite {f.get('seen', 'loss or gradients')}"
        rows.append([str(f["step"]), str(f["batch"]), why,
                     ", ".join(map(str, f["ranks"])), _cell(f.get("loss")), _cell(f.get("median")), action,
                     "; ".join(f"rank {r}: {t}" for r, t in f.get("rows", {}).items())])
    return ["", "## Numeric faults (train.on_nonfinite)", "",
            table(["step", "data batch", "why", "ranks", "loss", "spike median", "action", "rows"], rows)]
