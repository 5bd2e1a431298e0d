"""The objective's part of a plan as text: the headline of what one batch item is (the registry's rows and planner
field: a pair, or a completion of prompt + completion tokens) and a distillation run's teacher, every mode's bytes
and time beside the one used and the one recommended (planner/teacher.py)."""

from __future__ import annotations

from harness.config.defaults import REFERENCE_FREE
from harness.planner.inputs import Workload
from harness.planner.layouts import gb

TEACHER_NOTES = {"engine": "frozen weights + its logits", "adapter": "the base + its logits",
                 "precomputed": "top-k ids + log-probs", "served": "top-k ids + log-probs"}


def headline(w: Workload) -> list[str]:
    """One line saying what the micro batch counts for the objective (none for lm)."""
    if w.terms == "pairs":
        return [f"objective {w.objective}: the micro batch counts pairs, {2 * w.micro_batch} sequences (chosen and "
                f"rejected) per micro-step" + ("" if w.objective in REFERENCE_FREE else "; preference set "
                f"{f'{w.pairs:,} pairs' if w.pairs else 'size not given (--pairs)'}")]
    if w.terms not in ("rollouts", "distill"):
        return []
    rows = (f"objective {w.objective}: the micro batch counts completions, {w.micro_batch} per micro-step, each "
            f"{w.prompt_len:,} prompt + {w.completion_len:,} completion = {w.seq_len:,} tokens")
    if w.terms == "rollouts":
        ref = "no reference (beta 0: TRL loads none)" if not w.beta else f"beta {w.beta:g}: a reference per mode below"
        return [f"{rows}; generated in the loop; {ref}"]
    t = w.teacher
    source = "the dataset's (off-policy)"
    if t.on_policy:
        source = ("the student's own samples (on-policy)" if t.lmbda >= 1 else
                  f"the student's own samples with probability lmbda {t.lmbda:g}, else the dataset's")
    return [f"{rows}; completions: {source}",
            f"teacher   {t.name}: {t.params / 1e9:.2f} B params, vocab {t.vocab_size}; loss top-k {t.top_k} "
            f"(precomputed, served); records {f'{t.records:,}' if t.records else 'not given (--records)'}"]


def breakdown_line(mem: dict, width: int, gb_gib) -> list[str]:
    """The teacher's row among the per-GPU terms: the mode used, its weights and targets."""
    t = mem.get("teacher")
    if not t or not t["mode"]:
        return []
    used = t["modes"][t["mode"]]["gpu"]
    return [f"    {'teacher':<18} {t['mode'] + ': ' + TEACHER_NOTES[t['mode']]:<{width}}{gb_gib(used)}"]


def teacher_lines(t: dict, time: dict) -> list[str]:
    """Every teacher mode's bytes per rank, whether it fits, its time; the one used and the one recommended."""
    rec = "" if t["recommended"] == t["mode"] else f"; recommended: {t['recommended']}"
    lines = [f"  teacher ({t['objective']}): {t['mode']}{rec}: {t['why']}",
             f"    {'mode':<12}{'weights':>10}{'targets':>10}{'CPU/rank':>10}{'NVMe/rank':>10}  fits  time"]
    for mode, b in t["modes"].items():
        verdict = "n/a" if not b["applicable"] else "yes" if b["fits"] else "no"
        cells = [gb(v) if v else "-" for v in (b["weights_gpu"], b["targets"], b["cpu"], b["nvme"])]
        lines.append(f"    {mode:<12}{cells[0]:>10}{cells[1]:>10}{cells[2]:>10}{cells[3]:>10}  {verdict:<6}"
                     f"{_mode_time(mode, b, time, mode == t['mode'])}")
        if b["why_not"]:
            lines.append(f"      ({b['why_not']})")
    return lines


def _mode_time(mode: str, b: dict, time: dict, used: bool) -> str:
    if mode == "precomputed":
        disk = b.get("disk_bytes")
        took = time.get("teacher_pass_s")
        return ((f"store {gb(disk)} on disk" if disk is not None else "store size: --records not given")
                + (f"; one pass up front: {took:,.0f} s" if took is not None else "; one pass up front"))
    if mode == "served":
        return f"the endpoint holds {gb(b['endpoint_bytes'])}; none here"
    fwd = time.get("breakdown", {}).get("teacher_s") if used else None
    return "one teacher forward per micro-step" + (f": {fwd:.3g} s per step" if fwd else "")
