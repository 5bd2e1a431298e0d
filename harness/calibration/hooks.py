"""What engine.py's interleaved step times give: the optimizer step rate per ZeRO stage and the ZeRO hook
overhead per parameter tensor (engine_rates).

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

from harness.config.defaults import PRECISION_BYTES


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


def engine_rates(cfg: dict, engine: dict, profile: dict, precision: str, ranks: int) -> dict:
    """From engine.py's times on the cut model: the optimizer step rate per ZeRO stage (parameters
    stepped per second, the ZeRO-1/2 all-gather after the step taken out) and what ZeRO's hooks add to
    forward + backward per parameter tensor (stage s minus stage 0, each its fastest interleaved step less its
    collectives as the time model prices them on this profile's curves; never below 0: hook_overhead)."""
    from harness.planner import collectives, steptime
    from harness.planner.memory import harness_buckets
    from harness.planner.params import count_params

    from harness.calibration.engine import cut_config

    count = count_params(cut_config(cfg, engine["layers"]))
    lp, total = PRECISION_BYTES[precision], engine["params"]
    shard = -(-total // ranks)
    b = harness_buckets(cfg.get("hidden_size") or cfg.get("n_embd"))
    tensors = steptime.rank_tensors(count, engine["layers"], 1)
    calls = steptime.reduce_calls(tensors, b.reduce_bucket_elems)
    gathered = [n for n in tensors if n > b.param_persistence_threshold]

    def cs(op: str, nbytes: float, n_calls: int) -> float:
        return collectives.collective_s(profile, op, nbytes, ranks, inter=False, calls=n_calls)

    comm_fb = {"0": cs("all_reduce", lp * total, 1), "1": cs("all_reduce", lp * total, calls),
               "2": cs("all_reduce", lp * total, calls),
               "3": cs("reduce_scatter_tensor", lp * total, calls)
               + cs("all_gather_into_tensor", lp * sum(gathered) / ranks, len(gathered))}
    gather = cs("all_gather_into_tensor", lp * shard, 1)
    step_comm = {"1": gather, "2": gather, "2-offload": gather}
    stages = engine["stages"]
    rates, hooks, why = {}, {}, {}
    for s, t in stages.items():
        seconds = t["step_s"] - step_comm.get(s, 0.0)
        rates[s] = (total if s == "0" else shard) / max(seconds, 0.05 * t["step_s"])
        if s in comm_fb and s != "0":
            hooks[s], why[s] = hook_overhead(t, stages["0"], comm_fb[s], comm_fb["0"], len(tensors))
    return {"optimizer_params_per_s": rates, "zero_overhead_s_per_tensor": hooks, "zero_overhead_estimate": why}


def add_engine_rates(profile: dict, cfg: dict, engine: dict, precision: str, ranks: int, log) -> None:
    """The engine's times and the rates drawn from them (engine_rates) into profile["measured"], logged."""
    m = profile["measured"]
    m["engine"] = engine
    m.update(engine_rates(cfg, engine, profile, precision, ranks))
    log("  DeepSpeed step per ZeRO stage: " + ", ".join(
        f"ZeRO-{s} {r / 1e6:.0f} M params/s" for s, r in m["optimizer_params_per_s"].items())
        + " per rank; ZeRO hooks "
        + ", ".join(f"ZeRO-{s} {v * 1e3:.2f} ms" for s, v in m["zero_overhead_s_per_tensor"].items())
        + " per tensor and micro-step")
    for s, w in m["zero_overhead_estimate"].items():
        if "clamped" in w:
            log(f"  warning: ZeRO-{s} hooks {w['clamped']}; rerun `harness calibrate` on a quieter machine")
