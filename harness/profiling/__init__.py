"""Profiling hooks: communication per collective, memory per rank, throughput and MFU, DeepSpeed monitors.
May import: the ground floor, config/, planner/, data/, model/, checkpoint/.

Contract with harness/train/job.py:
  ds_overrides(spec, run_dir) -> dict   DeepSpeed keys merged into the config before initialize
  make_hooks(spec, engine, dist, run_dir, log, trackers) -> list of objects with
      before_step(step: int) -> None          step is 0-based (the trainer's loop index)
      after_step(step: int) -> dict | None    fields merged into that step's "train" record
      close() -> dict | None                  fields merged into summary.json (called on every rank)
  and optionally on_record(kind, step, record) -> None, called by the trainer after it logs a record.

The profile window (recipe `profile.steps`, `--profile-steps A-B`) counts in LOGGED step numbers: the
"step" field of metrics.jsonl, 1-based, so `5-8` profiles the records with step 5, 6, 7 and 8 (loop
indices 4..7). An empty string turns the window off. Steps of the window beyond the run are skipped.

What a run records (rank 0 writes; per-rank values are gathered to rank 0 with all_gather_object on the
profiled steps and once at close, so there are no per-rank files and no gathers on unmeasured steps):

  every "train" record:
    tflops_per_gpu, mfu        model FLOP/s (6N + attention, flops.py) per device; mfu is null on CPU
    memory                     rank 0, when profile.memory: cuda peak_allocated/peak_reserved/allocated bytes
                               (peaks reset every step) or cpu rss/peak_rss bytes
    fwd_ms, bwd_ms, bwd_inner_ms, bwd_allreduce_ms, step_ms
                               rank 0, when a window is set: DeepSpeed's wall-clock timers for the step
  profiled "train" records add, as lists indexed by rank:
    profiled: true
    comm_per_rank              [{collective: {"bytes", "count", "latency_ms"}}]  this step, comms logger
    memory_per_rank            [{... as memory ...}]
    model_states_per_rank      [{term: {device: bytes}}]  terms: params, grads, fp32_grads, fp32_master,
                               optimizer_moments, reduce_buckets, offload_buffers, other (memory.py);
                               devices: cuda, cpu, nvme (swap files)

  summary.json:
    startup      {"per_rank": [{"build"|"engine_setup": {"seconds", "peak_rss_bytes", "peak_rss_anon_bytes",
                  "rss_anon_before_bytes", "rss_anon_after_bytes", "in_use_after_bytes",
                  "cuda_peak_allocated_bytes"}}],
                  "predicted_per_rank": [{"build_bytes", "build_terms", "owned_params"}]}      (startup.py)
    profile      {"window": [A, B] or null, "step_numbering": "..."}
    comm         {"profiled_steps": [...], "measured_per_rank": [{collective: bytes per step}],
                  "count_per_rank": [...], "latency_ms_per_rank": [...],
                  "predicted": {collective: bytes per step} (rank 0's),
                  "predicted_per_rank": [...] (each rank's own: pipeline stages differ),
                  "predicted_by_group_per_rank": [{group: {collective: bytes}}] (dp, pp, tp, tied),
                  "prediction_notes": [...]}                                              (window only)
    pipeline     (pp > 1) {"pp", "micro_batches", "predicted_bubble": (p-1)/(m+p-1), "parts_planned",
                  "parts_engine", "stage_per_rank", "measured_bubble_per_rank", "instruction_ms_per_rank"}
                  (pipe.py: schedule instructions timed on the profiled steps)
    memory       {"device": "cuda"|"cpu", "peak_per_rank": [{peak_...: bytes}] (CPU: peak_in_use_bytes, the
                  RssAnon samples less malloc's free bytes, beside peak_rss_anon_bytes), "model_states_per_rank":
                  [...], "model_states_step": the step they were counted after (the last profiled step,
                  else the last step), "nvme_swap_bytes_per_rank": [...], "predicted": {"after_step",
                  "peak" ({term: {gpu, cpu, nvme}}), "activations", "peak_total_bytes" (the larger of
                  backward's model states + activations and the optimizer step's: memory.training_peak),
                  "after_step_by_stage", "params_per_rank", "notes"},
                  "predicted_peak_total_per_rank": [...] (each rank's own)}                 (profile.memory)
    throughput   {"flops_per_token", "tokens_per_step", "tokens_per_s_median", "tflops_per_gpu", "mfu",
                  "peak_tflops", "device_name", "precision", "mfu_note", "timers_ms_median": {...}}
  Predictions come from the planner (harness.planner.evaluate) with facts read off the live engine (live.py).

Optional DeepSpeed monitors (recipe `monitor.tensorboard` / `monitor.csv`) write into RUN/monitor/; the
harness adds the train loss, eval loss and tokens/s, which the plain engine does not log. Experiment trackers
(`monitor.wandb`, `monitor.mlflow`: harness/trackers/) get every record and the summary through the harness's own calls.
`harness report RUN` turns all of this into report.md with plots."""

from __future__ import annotations

from pathlib import Path

from harness.errors import UsageError

from harness.profiling.startup import Startup, predict_build, report_startup  # noqa: F401  (job.py's contract)

MONITOR_DIR = "monitor"


def parse_window(text: str | None) -> tuple[int, int] | None:
    """'5-8' -> (5, 8) in logged (1-based) step numbers; '' or None -> None (profiling off)."""
    if not text:
        return None
    try:
        first, last = (int(part) for part in str(text).split("-"))
    except ValueError:
        raise UsageError(f"profile.steps {text!r}: expected A-B, e.g. 5-8 (logged step numbers), "
                         "or '' to turn profiling off") from None
    if first < 1 or last < first:
        raise UsageError(f"profile.steps {text!r}: need 1 <= A <= B (steps are numbered from 1 as logged)\n"
                         "    fix: --profile-steps 5-8")
    return first, last


def window_of(spec) -> tuple[int, int] | None:
    return parse_window(spec.recipe.get("profile", {}).get("steps"))


def _monitor_overrides(spec, run_dir) -> dict:
    monitor = spec.recipe.get("monitor", {})
    out = {}
    path = str(Path(run_dir) / MONITOR_DIR)
    if monitor.get("tensorboard"):
        try:
            import tensorboard  # noqa: F401  (DeepSpeed's monitor imports torch.utils.tensorboard)
        except ImportError:
            raise UsageError("monitor.tensorboard is on but the tensorboard package is not installed\n"
                             "    fix: pip install tensorboard, or --set monitor.tensorboard=false "
                             "(monitor.csv needs nothing extra)") from None
        out["tensorboard"] = {"enabled": True, "output_path": path, "job_name": "tensorboard"}
    if monitor.get("csv"):
        out["csv_monitor"] = {"enabled": True, "output_path": path, "job_name": "csv"}
    return out


def ds_overrides(spec, run_dir) -> dict:
    """comms_logger and wall_clock_breakdown only when a window is set (DeepSpeed turns the comms logger on
    whenever its key is present, even with enabled=false); monitors when the recipe asks for them.

    Not wall_clock_breakdown with a pipeline: in DeepSpeed 0.19.8 the PipelineEngine starts bwd_microstep
    itself and the engine's backward hook starts it again on every stage but the last ("bwd_microstep timer
    has already been started"). The pipe hook (pipe.py) times the schedule's instructions instead."""
    out = _monitor_overrides(spec, run_dir)
    if window_of(spec) is not None:
        out["comms_logger"] = {"enabled": True, "verbose": False, "prof_all": True, "debug": False}
        if getattr(spec, "pp", 1) <= 1:
            out["wall_clock_breakdown"] = True
    return out


def make_hooks(spec, engine, dist, run_dir, log, trackers=None) -> list:
    """`trackers`: harness.trackers.start's result (rank 0's running trackers; empty elsewhere)."""
    from harness.profiling import comm, experts, live, memory, monitor, pipe, throughput

    window = window_of(spec)
    prediction = live.for_run(spec, engine)
    speed = throughput.ThroughputHook(spec, engine, dist, window)
    hooks: list = [speed]  # cheap: no sync, no gather
    if window is not None:
        hooks.append(comm.CommHook(dist, window, prediction))
    if getattr(spec, "pp", 1) > 1 and hasattr(engine, "_INSTRUCTION_MAP"):
        hooks.append(pipe.PipeHook(engine, dist, window, prediction))
    if spec.recipe.get("profile", {}).get("memory", True):
        hooks.append(memory.MemoryHook(spec, engine, dist, window, prediction))
    if getattr(engine, "monitor", None) is not None and engine.monitor.enabled:
        hooks.append(monitor.MonitorHook(engine, dist))
    if (expert_hook := experts.hook_for(engine, window)) is not None:  # MoE: tokens per expert per layer
        hooks.append(expert_hook)
    if trackers:
        hooks.append(trackers.hook(dist, speed.predicted.get("step_time_s")))
    return hooks
