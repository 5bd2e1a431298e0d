"""The report's layout changes: a headline line and a table of the checkpoint conversions that resumes on another
layout made (RUN/conversions.jsonl, harness/checkpoint/relayout.py): from which layout to which, how long it took
and rank 0's memory while it ran."""

from __future__ import annotations

import json
from pathlib import Path

from harness.checkpoint.relayout import CONVERSIONS
from harness.report.tables import fmt_bytes, table


def read(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / CONVERSIONS
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _layout(lay: dict) -> str:
    degrees = " ".join(f"{k} {lay[k]}" for k in ("dp", "tp", "pp", "sp", "ep") if lay.get(k) not in (None, 1))
    return f"world {lay.get('world_size')}{', ' + degrees if degrees else ''}, ZeRO-{lay.get('zero_stage')}"


def conversions_line(records: list[dict]) -> list[str]:
    if not records:
        return []
    spent = sum(r.get("seconds") or 0 for r in records)
    return [f"- layout changes: {len(records)} checkpoint conversion{'s' if len(records) != 1 else ''} on resume "
            f"({spent:.1f} s in all; {CONVERSIONS})"]


def conversions_section(records: list[dict]) -> list[str]:
    if not records:
        return []
    rows = []
    for r in records:
        before, peak = r.get("rss_anon_before_bytes"), r.get("peak_rss_anon_bytes")
        added = fmt_bytes(peak - before) if peak is not None and before is not None else "-"
        rows.append([r["tag"], _layout(r["from"]), _layout(r["to"]), f"{r.get('seconds', 0):.2f}", added,
                     fmt_bytes(r["peak_rss_bytes"]) if r.get("peak_rss_bytes") is not None else "-"])
    return ["", "## Layout changes (checkpoints converted on resume)", "",
            table(["checkpoint", "saved on", "resumed on", "seconds", "rank 0 private added", "rank 0 peak RSS"],
                  rows)]
