"""rl.async in the GRPO step (harness/train/grpo.py): the step's rollouts taken from the rank's generator process
(harness/rl/async_rollouts.py), tagged with the policy version that sampled them and their sampling log-probs;
after the update, the importance ratios the loss used go to rollouts.jsonl and the metrics, then the weights go to
the generator (every rl.weight_sync_steps steps).

Metrics (TRL's AsyncGRPO / GRPOTrainer names): sample/staleness_mean (the step minus the rollouts' model_version),
sample/dropped_stale_total (rollouts dropped for staleness so far, all ranks), sampling/importance_sampling_ratio/
mean, min, max (over the step's loss tokens), time/generator_s (the generator processes' own seconds on the step's
rollouts, the slowest rank's; time/generate_s is what the trainer waited for them); with the generators on CUDA
(rl.async_generator_device), memory/generator_peak_bytes: the largest generator process's peak CUDA memory so far
(its weights copy and KV cache, what harness plan --async prices per GPU).
"""

from __future__ import annotations

import time

from harness.dist import gather_all
from harness.rl.async_rollouts import raise_if_failed
from harness.rl.rollouts import append, lines, truncated


def describe(rl: dict) -> str:
    from harness.rl.generation.vllm_server import server_url

    where = (f"the vLLM server at {server_url(rl)}" if rl["generator"] == "vllm" else "a generator process per rank")
    return (f"async: {where} samples up to rl.max_staleness {rl['max_staleness']} step(s) "
            f"ahead on weights sent every rl.weight_sync_steps {rl['weight_sync_steps']} step(s); correction "
            f"{rl['async_correction']}" + (f" (cap {rl['vllm_importance_sampling_clip_max']})"
                                           if rl["async_correction"] == "tis" else " (PPO clip to the sampler)"))


def records(steps, step: int, index: list[int], prompt_ids: list, times: dict) -> list[dict]:
    """The step's records on every rank (collective); every rank raises GeneratorFailed if any rank's failed."""
    began = time.perf_counter()
    out = steps.async_gen.take(step)
    times["generate_s"] = time.perf_counter() - began
    local = None
    if "error" not in out:
        local = steps._scored(index, prompt_ids, out["completions"], times)
        for r, logps in zip(local, out["sampling_logps"]):
            r.update(model_version=out["version"], sampling_logps=logps)
    parts = gather_all({"error": out.get("error"), "records": local, "seconds": out.get("seconds", 0.0),
                        "dropped": steps.async_gen.dropped, "peak": out.get("peak_bytes", 0)})
    raise_if_failed([p["error"] for p in parts], steps.dp_rank, steps.async_gen)
    every = [r for p in parts for r in p["records"]]
    steps.async_stats = {"sample/staleness_mean": sum(step - r["model_version"] for r in every) / len(every),
                         "sample/dropped_stale_total": float(sum(p["dropped"] for p in parts)),
                         "time/generator_s": max(p["seconds"] for p in parts)}
    if any(p["peak"] for p in parts):
        steps.async_stats["memory/generator_peak_bytes"] = float(max(p["peak"] for p in parts))
    return every


def after_update(steps, step: int) -> dict:
    """The ratios the step's loss used into its records (written to rollouts.jsonl by rank 0) and the metrics; then
    the weight sync. Collective."""
    _, records, _ = steps.buffer
    ratios = [r for part in gather_all(steps.ratios) for r in part]
    used = []
    for record, ratio in zip(records, ratios):
        record["importance_ratios"] = ratio
        if not (steps.rl["mask_truncated_completions"] and truncated(record["completion_ids"], steps.eos_ids)):
            used += ratio
    if steps.dist.is_main:
        append(steps.run_dir, lines(step + 1, steps.g, records))
    steps.async_gen.after_step(step)
    metrics = dict(steps.async_stats)
    if used:
        metrics.update({"sampling/importance_sampling_ratio/mean": sum(used) / len(used),
                        "sampling/importance_sampling_ratio/min": min(used),
                        "sampling/importance_sampling_ratio/max": max(used)})
    return metrics
