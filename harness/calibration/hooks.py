"""The ZeRO hook overhead per parameter tensor from engine.py's interleaved step times.

The overhead is a small difference of two large times (stage s's forward + backward less stage 0's, each less
the collectives the time model prices apart), so on a shared machine the estimator decides the answer. The
difference of two 8-step medians timed minutes apart gave 2.24, 3.47 and -0.13 ms per tensor for ZeRO-2 in
three calibrations (issue #26). Here each stage's steps alternate with stage 0's (engine.py), so both
sides see the same load, and each side is its FASTEST step: on a shared machine other work only ever adds
time, so the minimum is the least disturbed sample (the estimator timeit's documentation recommends). An
overhead below zero is not physical: it is stored as 0 and said so.
"""

from __future__ import annotations

import statistics


def _fastest(t: dict, samples: str, fallback: str) -> float:
    return min(t[samples]) if t.get(samples) else t.get(fallback + "_min_s", t[fallback + "_s"])


def hook_overhead(stage: dict, base: dict, comm_stage_s: float, comm_base_s: float, tensors: int) -> tuple[float, dict]:
    """(seconds per tensor and micro-step, the numbers behind it).

    stage: engine.py's record of a ZeRO stage, "fwd_bwd_samples_s" (each step's slowest rank) and
    "base_fwd_bwd_samples_s" (the stage-0 steps interleaved with them); profiles from before the interleaving
    carry only "fwd_bwd_min_s" / "fwd_bwd_s", and `base` (stage 0's record) stands in for the base samples."""
    ours = _fastest(stage, "fwd_bwd_samples_s", "fwd_bwd")
    theirs = min(stage["base_fwd_bwd_samples_s"]) if stage.get("base_fwd_bwd_samples_s") else \
        _fastest(base, "fwd_bwd_samples_s", "fwd_bwd")
    raw = ((ours - comm_stage_s) - (theirs - comm_base_s)) / tensors
    why = {"raw_s_per_tensor": raw, "fastest_s": ours, "base_fastest_s": theirs}
    pairs = list(zip(stage.get("fwd_bwd_samples_s", []), stage.get("base_fwd_bwd_samples_s", [])))
    if pairs:  # the spread a single pair would have given: how much the minimum saved
        why["pair_differences_ms"] = [round((a - b) * 1e3, 2) for a, b in pairs]
        pair = statistics.median(a - b for a, b in pairs)
        why["median_pair_s_per_tensor"] = (pair - comm_stage_s + comm_base_s) / tensors
    if raw < 0:
        why["clamped"] = (f"{raw * 1e3:.3f} ms per tensor measured below zero (noise, or the collective curves "
                          "overprice this stage's calls): stored 0")
    return max(raw, 0.0), why
