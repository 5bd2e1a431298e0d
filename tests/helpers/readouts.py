"""Checks that a launched run shows what its objective's user watches (harness/config/readouts.py), shared by the
GRPO, preference and reward-model tests, which reuse their own launches: the [step] and [done] lines against
metrics.jsonl, `harness report`'s section, headline and plots against the same records, and the trackers' and
DeepSpeed CSV monitor's values under the objective's names. The expected numbers are computed here from the
records, with the arithmetic written out, not with the harness's own functions."""

from __future__ import annotations

import csv
import json
import re
import statistics
from pathlib import Path

from helpers.launch import records

STEP = re.compile(r"^\[step\]\s+(\d+)/\d+ (.*)$", re.M)
DONE = re.compile(r"^\[done\]\s+(\d+) steps, (.*); outputs in ", re.M)


def by_step(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in records(run_dir, "train")}


def check_step_lines(output: str, run_dir: Path, shown: tuple[str, ...], hidden: tuple[str, ...] = ()) -> int:
    """Every [step] line of `output` names each of `shown` with its metrics.jsonl value (4 decimals), none of
    `hidden`; returns how many lines were checked."""
    logged, lines = by_step(run_dir), STEP.findall(output)
    assert lines, f"no [step] line in:\n{output[-3000:]}"
    for step, text in lines:
        record = logged[int(step)]
        for name in shown:
            assert f"{name} {record[name]:.4f} " in text + " ", (step, name, record[name], text)
        for name in hidden:
            assert not re.search(rf"(^| ){re.escape(name)} ", text), (step, name, text)
    return len(lines)


def end_means(values: list[float], window: int) -> tuple[float, float]:
    k = max(1, min(window, len(values) // 2))
    return sum(values[:k]) / k, sum(values[-k:]) / k


def check_done_line(output: str, run_dir: Path, done: tuple[str, ...], window: int) -> dict[str, tuple]:
    """The [done] line: "name first -> last" for each of `done`, the means of the first and last `window` steps
    (at most half the steps each); summary.json's "readouts" the same numbers. Returns {name: (first, last)}."""
    found = DONE.findall(output)
    assert len(found) == 1, output[-3000:]
    steps, text = found[0]
    logged = [by_step(run_dir)[s] for s in sorted(by_step(run_dir))]
    assert int(steps) == len(logged)
    summary = json.loads((Path(run_dir) / "summary.json").read_text())["readouts"]
    out = {}
    for name in done:
        first, last = end_means([r[name] for r in logged], window)
        assert f"{name} {first:.4f} -> {last:.4f}" in text, (name, first, last, text)
        assert summary[name]["first"] == first and summary[name]["last"] == last, (name, summary[name])
        out[name] = (first, last)
    if window > 1 and len(logged) >= 2 * window:
        assert text.endswith(f"(means of the first and last {window} steps)"), text
    return out


def row(name: str, values: list[float], window: int) -> str:
    first, last = end_means(values, window)
    return f"| {name} | {first:.4f} | {last:.4f} | {min(values):.4f} | {max(values):.4f} |"


def check_report(run_dir: Path, rows: tuple[str, ...], window: int, plots: dict[str, tuple[str, ...]]) -> str:
    """`harness report` on the run: its section's table rows hold first / last / min / max of each of `rows` as
    metrics.jsonl gives them, each plot file is written and lists its series. Returns report.md."""
    from harness.cli import main

    assert main(["report", str(run_dir)]) == 0
    report = (Path(run_dir) / "report.md").read_text()
    logged = [by_step(run_dir)[s] for s in sorted(by_step(run_dir))]
    for name in rows:
        assert row(name, [r[name] for r in logged if r.get(name) is not None], window) in report, (name, report)
    for png, series in plots.items():
        assert (Path(run_dir) / png).stat().st_size > 10_000, png
        listed = re.search(rf"!\[{re.escape(png)}\]\({re.escape(png)}\)\nseries: (.*)", report).group(1)
        assert set(series) <= set(listed.split(", ")), (png, series, listed)
    return report


def time_split_rows(run_dir: Path, parts: tuple[str, ...]) -> list[str]:
    """The RL section's time table rows: median seconds per part and its share of the medians' sum."""
    logged = list(by_step(run_dir).values())
    medians = {p: statistics.median(r[f"time/{p}"] for r in logged) for p in parts}
    total = sum(medians.values())
    return [f"| {p} | {m:.4f} | {m / total:.0%} |" for p, m in medians.items()]


def csv_monitor(run_dir: Path, event: str) -> list[float]:
    """The values DeepSpeed's CSV monitor wrote for Train/Samples/<event> (one file per event, '/' -> '_')."""
    name = f"Train/Samples/{event}".replace("/", "_") + ".csv"
    found = sorted(Path(run_dir, "monitor").rglob(name))
    assert len(found) == 1, (name, sorted(p.name for p in Path(run_dir, "monitor").rglob("*.csv")))
    with open(found[0]) as f:
        return [float(line[1]) for line in list(csv.reader(f))[1:]]
