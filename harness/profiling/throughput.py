"""Throughput: model TFLOP/s and MFU per step, and DeepSpeed's forward/backward/step timers.

The trainer records tokens/s, samples/s and step time itself. This hook times the same span (its
before_step runs first and its after_step first, so the span is the trainer's step plus the other hooks'
cheap before_step work) and turns it into model FLOP/s per device (flops.py) and MFU against the peak of
the device (none on CPU: MFU is reported as null with a note rather than a made-up number).

DeepSpeed's timers need `wall_clock_breakdown`, which ds_overrides sets whenever profiling is on. With it
the engine (and the ZeRO optimizer) print their timers on every step; this hook replaces the timer group's
`log` with one that only resets the timers, and reads the values from `engine.get_wall_clock_timers()`
(the engine snapshots them just before it logs). On CPU the timers are host clocks; on CUDA they are
events, whose readout synchronizes once per step: with profiling on, this hook's step times are device
times; with it off (no timers) they are host times, and the trainer's tokens/s over each log interval,
taken after its loss all-reduce, is the number to trust.
"""

from __future__ import annotations

import time

from harness.profiling import flops
from harness.profiling.ranks import gather, logged, median

TIMERS = ("fwd", "bwd", "bwd_inner", "bwd_allreduce", "step")  # DeepSpeed's global (per-step) timers
WARMUP_STEPS = 1  # left out of the summary medians (first-step allocation, ZeRO-3 tracing)


def _quiet_log(timer_group):
    def log(names, normalizer=1.0, reset=True, memory_breakdown=False, ranks=None):
        if reset:
            for name in names:
                if name in timer_group.timers:
                    timer_group.timers[name].reset()
    return log


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(device)
    return device


def model_flops_per_token(module, seq_len: int) -> int | None:
    """Whole-model training FLOPs per token from the HF config (so tensor-parallel shards count in full)."""
    from harness.planner.params import count_params, model_shape

    config = getattr(module, "config", None)
    if config is None:
        return None
    try:
        cfg = config.to_dict()
        return flops.flops_per_token(count_params(cfg).total, model_shape(cfg), seq_len)
    except Exception:  # an architecture the planner cannot count: no TFLOP/s rather than a wrong one
        return None


class ThroughputHook:
    def __init__(self, spec, engine, dist, window):
        self.engine, self.dist, self.window = engine, dist, window
        ds = spec.ds_config
        seq_len = spec.recipe["train"]["seq_len"]
        self.tokens_per_step = ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * \
            spec.dp * seq_len
        self.world = spec.world_size
        self.precision = spec.recipe["precision"]
        self.flops_per_token = model_flops_per_token(engine.module, seq_len)
        self.device_name = device_name(dist.device)
        self.peak, self.mfu_note = flops.peak_tflops(self.device_name, self.precision)
        self.timers_on = bool(ds.get("wall_clock_breakdown")) and hasattr(engine, "get_wall_clock_timers")
        if self.timers_on:
            engine.timers.log = _quiet_log(engine.timers)
        self.rows: list[dict] = []
        self._start = 0.0
        from harness.profiling.live import step_time_for_run

        self.predicted = step_time_for_run(spec, engine, dist.device, self.device_name, _device_memory(dist.device))

    def before_step(self, step: int) -> None:
        self._start = time.perf_counter()

    def after_step(self, step: int) -> dict:
        elapsed = time.perf_counter() - self._start
        tokens_per_s = self.tokens_per_step / elapsed
        row: dict = {}
        if self.flops_per_token:
            row["tflops_per_gpu"] = tokens_per_s * self.flops_per_token / self.world / 1e12
            row["mfu"] = flops.mfu(tokens_per_s, self.flops_per_token, self.world, self.peak)
        if self.timers_on:
            cache = self.engine.get_wall_clock_timers() or {}
            row.update({f"{name}_ms": cache[name] for name in TIMERS if name in cache})
        if logged(step) > WARMUP_STEPS:
            self.rows.append(dict(row, tokens_per_s=tokens_per_s))
        return row

    def close(self) -> dict:
        def med(key):
            return median([r.get(key) for r in self.rows])

        out = {"flops_per_token": self.flops_per_token, "tokens_per_step": self.tokens_per_step,
               "tokens_per_s_median": med("tokens_per_s"), "tflops_per_gpu": med("tflops_per_gpu"),
               "mfu": med("mfu"), "peak_tflops": self.peak, "device_name": self.device_name,
               "precision": self.precision, "timers_ms_median": {n: med(f"{n}_ms") for n in TIMERS
                                                                 if med(f"{n}_ms") is not None}}
        if self.mfu_note:
            out["mfu_note"] = self.mfu_note
        window = list(self.window) if self.window else None
        step_s = [self.tokens_per_step / r["tokens_per_s"] for r in self.rows]
        per_rank = gather(median(step_s))
        predicted = self.predicted.get("step_time_s")
        measured = median(per_rank)
        out["step_time"] = dict(self.predicted, measured_median_s_per_rank=per_rank,
                                ratio=measured / predicted if predicted and measured else None)
        return {"throughput": out,
                "profile": {"window": window, "step_numbering": "logged steps, 1-based (the records' step)"}}


def _device_memory(device: str) -> int:
    """Bytes of one device's memory (on the CPU accelerator: host RAM shared by the local ranks)."""
    if str(device).startswith("cuda"):
        import torch

        return torch.cuda.get_device_properties(device).total_memory
    import psutil

    from harness.dist import launched

    launch = launched()  # the ranks on this node, as the launcher said (none: this process alone)
    return psutil.virtual_memory().total // max(launch.local_size if launch else 1, 1)
