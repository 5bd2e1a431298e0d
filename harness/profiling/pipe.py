"""Pipeline engine: time spent per schedule instruction on profiled steps, and the measured bubble per rank.

DeepSpeed's own pipe timers need wall_clock_breakdown, which crashes the PipelineEngine in 0.19.8 (see
ds_overrides), so this hook times the instructions itself: the engine runs each instruction of its 1F1B
schedule through `self._INSTRUCTION_MAP[type(cmd)]`, and an instance attribute of the same name, holding
timed copies of those methods, takes precedence over the class's. Outside the window the copies only call
through; inside it they synchronize the device around each instruction (so CUDA times are device times).

Measured bubble of a rank: the share of its schedule (every instruction but the optimizer step and the
gradient reductions after the last micro-batch) that is not forward or backward compute: waiting in
send/recv for a neighbour, loading micro-batches. The planner's (p-1)/(m+p-1) assumes equal stages and free
communication; the measured value includes unequal stages (the last one also computes the head and loss)
and p2p transfer time.
"""

from __future__ import annotations

import time

from harness.profiling.ranks import gather, in_window

COMPUTE = ("ForwardPass", "BackwardPass")
AFTER_SCHEDULE = ("OptimizerStep", "ReduceGrads", "ReduceTiedGrads")  # outside the 1F1B bubble model


def measured_bubble(ms: dict[str, float]) -> float | None:
    """1 - compute / schedule span from {instruction: ms} of one step (or a mean of steps)."""
    span = sum(v for k, v in ms.items() if k not in AFTER_SCHEDULE)
    if span <= 0:
        return None
    return 1 - sum(ms.get(k, 0.0) for k in COMPUTE) / span


class PipeHook:
    def __init__(self, engine, dist, window, prediction: dict):
        self.engine, self.dist, self.window, self.prediction = engine, dist, window, prediction
        self.active = False
        self.current: dict[str, float] = {}
        self.steps: list[dict[str, float]] = []
        self._sync = self._synchronizer(dist.device)
        engine._INSTRUCTION_MAP = {kind: self._timed(kind.__name__, fn)
                                   for kind, fn in type(engine)._INSTRUCTION_MAP.items()}

    @staticmethod
    def _synchronizer(device: str):
        if device.startswith("cuda"):
            import torch

            return torch.cuda.synchronize
        return lambda: None

    def _timed(self, name: str, fn):
        def run(engine, **kwargs):
            if not self.active:
                return fn(engine, **kwargs)
            self._sync()
            start = time.perf_counter()
            try:
                return fn(engine, **kwargs)
            finally:
                self._sync()
                self.current[name] = self.current.get(name, 0.0) + 1000 * (time.perf_counter() - start)
        return run

    def before_step(self, step: int) -> None:
        self.active = in_window(step, self.window)
        self.current = {}

    def after_step(self, step: int) -> dict | None:
        if not self.active:
            return None
        self.active = False
        self.steps.append(self.current)
        mine = {"stage": self.engine.stage_id, "bubble": measured_bubble(self.current)}
        return {"pipe_per_rank": gather(mine)}

    def close(self) -> dict:
        names = sorted({k for s in self.steps for k in s})
        mean = {k: sum(s.get(k, 0.0) for s in self.steps) / len(self.steps) for k in names} if self.steps else {}
        per_rank = gather({"stage": self.engine.stage_id, "instruction_ms": mean,
                           "bubble": measured_bubble(mean) if mean else None})
        return {"pipeline": {
            "pp": self.prediction.get("pp"), "micro_batches": self.prediction.get("micro_batches"),
            "predicted_bubble": self.prediction.get("bubble_fraction"),
            "parts_planned": self.prediction.get("parts_planned"), "parts_engine": self.prediction.get("parts_engine"),
            "stage_per_rank": [r["stage"] for r in per_rank],
            "measured_bubble_per_rank": [r["bubble"] for r in per_rank],
            "instruction_ms_per_rank": [r["instruction_ms"] for r in per_rank]}}
