"""The report's restarts: one line in the headline and a table of what `harness launch --max-restarts` or `harness
ray` restarted (RUN/restarts.jsonl, harness/train/restarts.py): which attempt failed (or, `harness ray --min-nodes`,
was stopped to grow back to every node), why, the backoff and where it resumed."""

from __future__ import annotations

import datetime

from harness.report.tables import table


def restarts_line(records: list[dict]) -> list[str]:
    if not records:
        return []
    tags = ", ".join(r["resume_from"] or "the start" for r in records)
    grown = sum(1 for r in records if r.get("grow_back"))
    return [f"- restarts: {len(records)} ({_by(records)}{f', {grown} of them grow-backs' if grown else ''}), "
            f"resumed from {tags}"]


def _by(records: list[dict]) -> str:
    """Who restarted: `harness ray` names itself in its records; older records are `harness launch`'s."""
    return ", ".join(sorted({r.get("launcher", "harness launch --max-restarts") for r in records}))


def restarts_section(records: list[dict]) -> list[str]:
    if not records:
        return []

    def when(t: float) -> str:
        return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")

    return ["", f"## Restarts ({_by(records)})", "",
            table(["failed attempt", "time", "exit", "why", "backoff s", "resumed from"],
                  [[str(r["attempt"]), when(r["time"]), "grow-back" if r.get("grow_back") else str(r["code"]),
                    r["reason"], f"{r['backoff_s']:g}", r["resume_from"] or "the start (no complete checkpoint)"]
                   for r in records])]

