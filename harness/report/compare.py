"""A run folder -> report.md + PNG plots + report.json: measured beside what the planner predicted.

Reads runs/ID/metrics.jsonl, summary.json, recipe.json and ds_config.json (the outputs described in
harness/profiling/__init__.py); writes, into the run folder, report.md (tables, flags, plots), report.json
(the same tables as data) and the PNGs from report_plots.py. Pure except for file I/O and matplotlib.

Tolerances behind the flags: model states 2 %, logged comm bytes 5 % (what the planner claims), peak
memory 25 % (activations and allocator behaviour are rougher). Flags also name results that contradict the
strategy ordering: a higher ZeRO stage holding more per rank than the planner says a lower one would, and,
across several runs of one model and world size, a higher stage peaking above a lower one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from harness.errors import UsageError
from harness.report.experts import experts_section
from harness.report.mixture import sources_section
from harness.report.objective import lengths, objective_section, section_tables, steps_line
from harness.report.faults import faults_line, faults_section
from harness.report.tables import fmt_bytes, fmt_ratio, ratio, table
from harness.report.pipeline import pipeline_flags, pipeline_rows, pipeline_section
from harness.report.conversions import conversions_line, conversions_section
from harness.report.conversions import read as read_conversions
from harness.report.restarts import restarts_line, restarts_section
from harness.report.startup import startup_rows, startup_section
from harness.report.step_time import step_time_section
from harness.train.metrics import read_metrics
from harness.train.restarts import read as read_restarts

STATE_TOL, COMM_TOL, PEAK_TOL = 0.02, 0.05, 0.25
CPU_PEAK_MIN_BYTES = 512 * 2**20  # CPU ranks: below this the process's own growth after the build decides
STATE_TERMS = ("params", "grads", "fp32_grads", "fp32_master", "optimizer_moments", "reduce_buckets",
               "gathered_params", "offload_buffers", "other")
SMALL_BYTES = 1024  # measured-only bytes below this (bookkeeping scalars) are not flagged
ORDER_MARGIN = 0.10  # a higher stage must exceed a lower one by this much to be flagged (not noise)


@dataclass
class Run:
    path: Path
    records: list[dict]
    summary: dict
    recipe: dict
    ds_config: dict
    notes: list[str] = field(default_factory=list)
    restarts: list[dict] = field(default_factory=list)  # restarts.jsonl: harness launch --max-restarts
    conversions: list[dict] = field(default_factory=list)  # conversions.jsonl: resumes on another layout

    @property
    def train(self) -> list[dict]:
        """One record per step, in step order: a step redone after a restart from an earlier checkpoint (or a
        resume after a crash) counts once, as its last record."""
        last = {r["step"]: r for r in self.records if r.get("kind") == "train"}
        return [last[s] for s in sorted(last)]

    @property
    def eval(self) -> list[dict]:
        return [r for r in self.records if r.get("kind") == "eval"]

    @property
    def stage(self) -> int:
        return self.ds_config.get("zero_optimization", {}).get("stage", 0)

    @property
    def label(self) -> str:
        return f"{self.summary.get('recipe', self.path.name)} ({self.path.name})"


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def load_run(run_dir) -> Run:
    path = Path(run_dir)
    if not (path / "metrics.jsonl").exists():
        raise UsageError(f"{path}: no metrics.jsonl here, so it is not a run folder (or the run never "
                         "logged a step)\n    fix: pass the folder a run wrote, e.g. runs/2026-11-30_zero2")
    run = Run(path, read_metrics(path), _json(path / "summary.json"), _json(path / "recipe.json"),
              _json(path / "ds_config.json"), restarts=read_restarts(path), conversions=read_conversions(path))
    if not run.summary:
        run.notes.append("no summary.json: the run did not finish; tables use metrics.jsonl only")
    return run


def _flag(r: float | None, tol: float) -> str:
    if r is None:
        return ""
    return "" if abs(r - 1) <= tol else f"off by {100 * (r - 1):+.1f}%"


def _total(devices: dict | None) -> int:
    return sum((devices or {}).values())


def _grand_total(states: dict | None) -> int:
    """Bytes over every term and device of {term: {device: bytes}}."""
    return sum(_total(v) for v in (states or {}).values())


def _devices(devices: dict | None, accelerator: str | None = None) -> set[str]:
    """Device names holding bytes; with `accelerator`, planner names (gpu/cpu/nvme) become measured ones
    (on a CPU-only run the planner's "gpu" is the CPU)."""
    names = {"gpu": "cuda" if accelerator == "cuda" else "cpu", "cpu": "cpu", "nvme": "nvme"}
    return {names.get(d, d) if accelerator else d for d, b in (devices or {}).items() if b}


def state_rows(run: Run) -> list[dict]:
    """Model-state bytes per term: predicted (after a step) vs each rank's count, and where each lives."""
    memory = run.summary.get("memory", {})
    accelerator = memory.get("device", "cpu")
    predicted = memory.get("predicted", {}).get("after_step", {})
    ranks = memory.get("model_states_per_rank", [])
    if not ranks:
        last = next((r for r in reversed(run.train) if r.get("model_states_per_rank")), None)
        ranks = last["model_states_per_rank"] if last else []
    # each rank against its own prediction where the run recorded them (ZeRO-1/2 partition edges differ)
    own = memory.get("predicted_after_step_per_rank") or [predicted] * len(ranks)
    rows = []
    for term in STATE_TERMS:
        pred = _total(predicted.get(term)) if predicted else None
        measured = [_total(rank.get(term)) for rank in ranks]
        if not pred and not any(measured):
            continue
        ratios = [ratio(m, _total((p or {}).get(term))) for m, p in zip(measured, own)]
        flags = [_flag(r, STATE_TOL) for r in ratios]
        if not pred and predicted and max(measured, default=0) >= SMALL_BYTES:
            flags = ["not in the planner's model"]
        where = set().union(*(_devices(rank.get(term)) for rank in ranks)) if ranks else set()
        want = _devices(predicted.get(term), accelerator)
        if pred and any(measured) and want != where:
            flags.append(f"predicted on {'+'.join(sorted(want))}, measured on {'+'.join(sorted(where))}")
        rows.append({"term": term, "predicted": pred, "measured": measured, "ratio": ratios,
                     "predicted_per_rank": [_total((p or {}).get(term)) for p in own],
                     "devices": sorted(where), "predicted_devices": sorted(want),
                     "flag": "; ".join(sorted({f for f in flags if f}))})
    if rows:
        pred_total = _grand_total(predicted) if predicted else None
        measured = [_grand_total(rank) for rank in ranks]
        ratios = [ratio(m, _grand_total(p)) for m, p in zip(measured, own)]
        rows.append({"term": "total", "predicted": pred_total, "measured": measured, "ratio": ratios,
                     "predicted_per_rank": [_grand_total(p) for p in own],
                     "devices": [], "flag": "; ".join(sorted({f for f in (_flag(r, STATE_TOL) for r in ratios) if f}))})
    return rows


def comm_rows(run: Run) -> list[dict]:
    """Logged bytes per collective and rank; each rank against its own prediction where the run recorded them
    (pipeline stages differ: the end stages have one neighbour, the middle ones two)."""
    comm = run.summary.get("comm", {})
    predicted = comm.get("predicted", {})
    ranks = comm.get("measured_per_rank", [])
    own = comm.get("predicted_per_rank") or [predicted] * len(ranks)
    rows = []
    ops = set(predicted) | {op for p in own for op in p} | {op for rank in ranks for op in rank}
    for op in sorted(ops):
        preds = [p.get(op) for p in own]
        pred = preds[0] if len(set(preds)) <= 1 and preds else predicted.get(op)
        measured = [rank.get(op, 0) for rank in ranks]
        ratios = [ratio(m, p) for m, p in zip(measured, preds)]
        flags = {_flag(r, COMM_TOL) for r in ratios} - {""}
        if all(p is None for p in preds) and max(measured, default=0) >= SMALL_BYTES:
            flags = {"not in the planner's model"}
        rows.append({"collective": op, "predicted": pred, "predicted_per_rank": preds, "measured": measured,
                     "ratio": ratios,
                     "count": [c.get(op, 0) for c in comm.get("count_per_rank", [])],
                     "latency_ms": [c.get(op, 0) for c in comm.get("latency_ms_per_rank", [])],
                     "flag": "; ".join(sorted(flags))})
    return rows


def peak_rows(run: Run) -> list[dict]:
    """Each rank's training peak beside its own prediction. CUDA: max_memory_allocated. CPU: the memory in use
    (RssAnon less what malloc holds free) above the rank's own before the model was built (the interpreter and
    libraries), compared once the prediction is large enough for that baseline's drift not to decide it."""
    memory = run.summary.get("memory", {})
    cuda = memory.get("device") == "cuda"
    predicted_all = memory.get("predicted", {}).get("peak_total_bytes")
    own = memory.get("predicted_peak_total_per_rank") or []
    startup = run.summary.get("startup", {}).get("per_rank") or []
    rows = []
    for rank, peaks in enumerate(memory.get("peak_per_rank", [])):
        predicted = (own[rank] if rank < len(own) else None) or predicted_all
        if cuda:
            key, measured, flag = "peak_allocated_bytes", peaks.get("peak_allocated_bytes"), None
        else:
            key, flag = "peak_in_use_bytes" if "peak_in_use_bytes" in peaks else "peak_rss_anon_bytes", None
            baseline = (startup[rank].get("build") or {}).get("rss_anon_before_bytes") if rank < len(startup) else None
            measured = peaks.get(key)
            if measured is None or baseline is None:
                flag = "CPU run: no private-memory peak or baseline recorded, compare model states instead"
            else:
                measured, key = measured - baseline, f"{key} above the rank's baseline {fmt_bytes(baseline)}"
                if not predicted or predicted < CPU_PEAK_MIN_BYTES:
                    flag = (f"CPU run: a prediction under {fmt_bytes(CPU_PEAK_MIN_BYTES)} is within the process's "
                            "own drift (data, engine objects); compare model states instead")
        r = ratio(measured, predicted) if flag is None else None
        rows.append({"rank": rank, "measured_key": key, "measured": measured, "predicted": predicted, "ratio": r,
                     "flag": _flag(r, PEAK_TOL) if flag is None else flag})
    return rows


def stage_flags(run: Run) -> list[str]:
    """A run whose measured model states exceed what the planner predicts for a lower ZeRO stage."""
    memory = run.summary.get("memory", {})
    by_stage = memory.get("predicted", {}).get("after_step_by_stage", {})
    ranks = memory.get("model_states_per_rank", [])
    if not by_stage or not ranks or run.stage == 0:
        return []
    fullest = max(ranks, key=lambda rank: sum(_total(v) for v in rank.values()))
    measured = sum(_total(v) for v in fullest.values())
    largest = max(fullest, key=lambda term: _total(fullest[term]))
    out = []
    for lower in reversed(range(run.stage)):  # name the nearest lower stage it exceeds
        pred = by_stage.get(str(lower))
        if pred and measured > pred * (1 + ORDER_MARGIN):
            out.append(f"ZeRO-{run.stage} holds {fmt_bytes(measured)} of model states per rank, more than "
                       f"ZeRO-{lower} would ({fmt_bytes(pred)} predicted); largest term {largest} "
                       f"({fmt_bytes(_total(fullest[largest]))}): fixed-size buffers outweigh the sharding at "
                       "this model size (size buckets and swap buffers from the model)")
            break
    return out


def compare_flags(runs: list[Run]) -> list[str]:
    """Across runs of one model and world size: a higher ZeRO stage peaking above a lower one."""
    def peak(run: Run) -> int | None:
        key = "peak_allocated_bytes" if run.summary.get("memory", {}).get("device") == "cuda" else None
        peaks = run.summary.get("memory", {}).get("peak_per_rank", [])
        if key and peaks:
            return max(p.get(key, 0) for p in peaks)
        states = run.summary.get("memory", {}).get("model_states_per_rank", [])
        return max((sum(_total(v) for v in s.values()) for s in states), default=None)

    out = []
    groups: dict[tuple, list[Run]] = {}
    for run in runs:
        key = (run.recipe.get("train", {}).get("model"), run.summary.get("world_size"))
        groups.setdefault(key, []).append(run)
    for group in groups.values():
        for hi in group:
            for lo in group:
                p_hi, p_lo = peak(hi), peak(lo)
                if hi.stage > lo.stage and p_hi and p_lo and p_hi > p_lo * (1 + ORDER_MARGIN):
                    out.append(f"ZeRO-{hi.stage} ({hi.label}) peaks at {fmt_bytes(p_hi)}, above ZeRO-{lo.stage} "
                               f"({lo.label}) at {fmt_bytes(p_lo)}")
    return out


def _per_rank(values: list, fmt) -> list[str]:
    return [fmt(v) for v in values]


def _predicted_cell(row: dict) -> str:
    """One value, or each rank's own when they differ (pipeline stages)."""
    preds = row.get("predicted_per_rank") or [row["predicted"]]
    return fmt_bytes(row["predicted"]) if len(set(preds)) <= 1 else " / ".join(_per_rank(preds, fmt_bytes))


def headline(run: Run) -> list[str]:
    s, t = run.summary, run.summary.get("throughput", {})
    zero = run.ds_config.get("zero_optimization", {})
    train = run.recipe.get("train", {})
    lines = [f"- recipe **{s.get('recipe', '?')}**, world size {s.get('world_size', '?')}, ZeRO stage "
             f"{zero.get('stage', 0)}, {run.recipe.get('precision', '?')}, model {train.get('model', '?')}, "
             f"{lengths(run)}"]
    if run.train:
        lines.append(steps_line(run))
    if t:
        mfu = f"{100 * t['mfu']:.1f}%" if t.get("mfu") is not None else f"n/a ({t.get('mfu_note', 'no peak')})"
        tflops = f"{t['tflops_per_gpu']:.4g}" if t.get("tflops_per_gpu") is not None else "n/a"
        tok = f"{t['tokens_per_s_median']:.0f}" if t.get("tokens_per_s_median") else "n/a"
        fpt = f"; {t['flops_per_token']:.3g} model FLOPs/token" if t.get("flops_per_token") else ""
        lines.append(f"- throughput (median after step 1): {tok} tokens/s, {tflops} TFLOP/s per device, "
                     f"MFU {mfu}{fpt}")
        lines.append(f"- device: {t.get('device_name', '?')}, {t.get('precision', '?')}, dense peak "
                     f"{t.get('peak_tflops') or 'n/a'} TFLOP/s")
    window = s.get("profile", {}).get("window")
    lines.append(f"- profiled steps: {window[0]}-{window[1]} (logged step numbers)" if window
                 else "- profiling window: off (no comm measurement)")
    return (lines + restarts_line(run.restarts) + conversions_line(run.conversions) + faults_line(run.records)
            + [f"- note: {n}" for n in run.notes])


def render(run: Run, tables: dict, flags: list[str], plots: dict[str, list[str]]) -> str:
    n_ranks = max([len(r["measured"]) for r in tables["states"] + tables["comm"]] or [0])
    ranks = [f"rank {i}" for i in range(n_ranks)]
    out = [f"# Run report: {run.label}", "", *headline(run), "", "## Flags", ""]
    out += [f"- {f}" for f in flags] or ["- none: every measured value is within tolerance of its prediction"]
    out += ["", "## Model states per rank after a step (predicted vs measured)", ""]
    if tables["states"]:
        out.append(table(["term", "predicted", *ranks, "ratio (per rank)", "where (measured)", "flag"], [
            [r["term"], _predicted_cell(r), *_per_rank(r["measured"], fmt_bytes),
             " / ".join(_per_rank(r["ratio"], fmt_ratio)), "+".join(r["devices"]), r["flag"]]
            for r in tables["states"]]))
    else:
        out.append("not recorded (profile.memory was off)")
    out += ["", "## Communication per step, logged bytes (predicted vs measured)", ""]
    if tables["comm"]:
        out.append(table(["collective", "predicted", *ranks, "ratio (per rank)", "calls/step",
                           "latency ms/step", "flag"], [
            [r["collective"], _predicted_cell(r), *_per_rank(r["measured"], fmt_bytes),
             " / ".join(_per_rank(r["ratio"], fmt_ratio)), " / ".join(f"{c:g}" for c in r["count"]),
             " / ".join(f"{v:.1f}" for v in r["latency_ms"]), r["flag"]] for r in tables["comm"]]))
        notes = run.summary.get("comm", {}).get("prediction_notes", [])
        out += [""] + [f"- {n}" for n in notes]
    else:
        out.append("not measured (no profile window)")
    out += ["", "## Peak memory per rank", ""]
    if tables["peak"]:
        out.append(table(["rank", "measured", "predicted (backward + activations, or the step)", "ratio", "flag"], [
            [str(r["rank"]), f"{fmt_bytes(r['measured'])} ({r['measured_key']})", fmt_bytes(r["predicted"]),
             fmt_ratio(r["ratio"]), r["flag"]] for r in tables["peak"]]))
    else:
        out.append("not recorded")
    out += restarts_section(run.restarts)
    out += conversions_section(run.conversions)
    out += faults_section(run.records)
    out += startup_section(tables.get("startup", []))
    out += pipeline_section(run, tables.get("pipeline", []))
    out += experts_section(run)
    out += sources_section(run)
    out += objective_section(run, tables.get("objective", {}))
    timers = run.summary.get("throughput", {}).get("timers_ms_median", {})
    if timers:
        out += ["", "## Step time breakdown (DeepSpeed timers, median ms, rank 0)", "",
                table(list(timers), [[f"{v:.2f}" for v in timers.values()]])]

    out += step_time_section(run)
    out += ["", "## Plots", ""]
    for name, series in plots.items():
        out += [f"![{name}]({name})", f"series: {', '.join(series) or 'none (not recorded)'}", ""]
    return "\n".join(out) + "\n"


def write_report(run_dir, others: list | None = None) -> Path:
    """Write report.md, report.json and the plots into run_dir; return the report path."""
    from harness.report import plots as report_plots
    from harness.report.objective_plots import write_rl

    run = load_run(run_dir)
    tables = {"states": state_rows(run), "comm": comm_rows(run), "peak": peak_rows(run),
              "pipeline": pipeline_rows(run), "startup": startup_rows(run), "objective": section_tables(run)}
    flags = [f"model states, {r['term']}: {r['flag']}" for r in tables["states"] if r["flag"]]
    flags += pipeline_flags(run)
    flags += [f"comm, {r['collective']}: {r['flag']}" for r in tables["comm"] if r["flag"]]
    flags += [f"peak memory, rank {r['rank']}: {r['flag']}" for r in tables["peak"]
              if r["flag"] and r["ratio"] is not None]
    flags += stage_flags(run)
    if others:
        flags += [f for f in compare_flags([run, *(load_run(o) for o in others)]) if run.label in f]
    try:
        plots = report_plots.write_all(run, tables, run.path)
        plots.update(write_rl(run, run.path))
    except ImportError:  # a bare GPU image without matplotlib still gets the tables
        plots = {}
        run.notes.append("matplotlib is not installed: no plots (pip install matplotlib)")
    path = run.path / "report.md"
    path.write_text(render(run, tables, flags, plots))
    (run.path / "report.json").write_text(json.dumps({"tables": tables, "flags": flags, "plots": plots},
                                                     indent=2) + "\n")
    return path
