"""Communication per collective on profiled steps, every rank, from DeepSpeed's comms logger.

The comms logger makes every logged op blocking (it synchronizes after each one), so it is switched on
only inside the profile window: `ds_overrides` puts the `comms_logger` key in the config (DeepSpeed then
configures the logger at initialize), this hook turns `comms_logger.enabled` off right away and back on
for the profiled steps only, resetting the logger's data before each. The raw data
({op: {msg_bytes: [count, [latency_ms], [algbw], [busbw]]}}) becomes, per rank and step,
{op: {"bytes": sum of msg_bytes x count, "count": n, "latency_ms": summed latency}}; op names are the
logger's (all_reduce, all_gather_into_tensor, reduce_scatter_tensor, broadcast, send, recv, ...), whose
byte convention is the planner's "logged bytes" (planner/comm.py). The harness's own gathers go through
torch.distributed directly and are never logged.
"""

from __future__ import annotations

from harness.profiling.ranks import gather, in_window


def _logger():
    from deepspeed.comm import comms_logger

    return comms_logger


def _op_timers():
    """The timer group DeepSpeed's timed_op uses, one timer per logged op name."""
    from deepspeed.comm import comm

    return comm.timers


def summarize(raw: dict, latency_ms: dict[str, float] | None = None) -> dict:
    """Comms-logger raw data -> {op: {"bytes", "count", "latency_ms"}}.

    Latency comes from the op timers themselves (`latency_ms`, elapsed since the step began): the
    latencies in the raw data are each timer's running total (timed_op reads elapsed(reset=False)), so
    summing them would count early calls many times over."""
    out = {}
    for op, sizes in raw.items():
        count = sum(v[0] for v in sizes.values())
        nbytes = sum(int(size) * v[0] for size, v in sizes.items())
        latency = (latency_ms or {}).get(op, max((max(v[1], default=0.0) for v in sizes.values()), default=0.0))
        out[op] = {"bytes": nbytes, "count": count, "latency_ms": round(latency, 4)}
    return dict(sorted(out.items()))


def per_step_mean(steps: list[dict], key: str) -> dict:
    """Mean of one field per op over profiled steps (an op absent from a step counts as 0 there)."""
    ops = sorted({op for step in steps for op in step})
    return {op: sum(step.get(op, {}).get(key, 0) for step in steps) / len(steps) for op in ops} if steps else {}


class CommHook:
    def __init__(self, dist, window: tuple[int, int], prediction: dict):
        self.dist, self.window, self.prediction = dist, window, prediction
        self.logger, self.timers = _logger(), _op_timers()
        self.logger.enabled = False  # on only inside the window: logged ops are blocking
        self.steps: list[dict] = []  # this rank's profiled steps
        self.profiled: list[int] = []

    def before_step(self, step: int) -> None:
        if in_window(step, self.window):
            self.logger.reset_data()
            for timer in self.timers.timers.values():
                timer.reset()
            self.logger.enabled = True

    def after_step(self, step: int) -> dict | None:
        if not in_window(step, self.window):
            return None
        self.logger.enabled = False
        raw = self.logger.get_raw_data()
        latency = {op: self.timers.timers[op].elapsed(reset=True) for op in raw if op in self.timers.timers}
        mine = summarize(raw, latency)
        self.logger.reset_data()
        self.steps.append(mine)
        self.profiled.append(step + 1)
        return {"profiled": True, "comm_per_rank": gather(mine)}

    def close(self) -> dict:
        per_rank = gather({"bytes": per_step_mean(self.steps, "bytes"),
                           "count": per_step_mean(self.steps, "count"),
                           "latency_ms": per_step_mean(self.steps, "latency_ms"),
                           "predicted": self.prediction.get("comm", {}),
                           "by_group": self.prediction.get("comm_by_group")})
        out = {"profiled_steps": self.profiled,
               "measured_per_rank": [r["bytes"] for r in per_rank],
               "count_per_rank": [r["count"] for r in per_rank],
               "latency_ms_per_rank": [r["latency_ms"] for r in per_rank],
               "predicted": self.prediction.get("comm", {}),
               # each rank's own: pipeline stages (and their tensor-parallel blocks) differ
               "predicted_per_rank": [r["predicted"] for r in per_rank],
               "prediction_notes": self.prediction.get("notes", [])}
        if any(r["by_group"] for r in per_rank):
            out["predicted_by_group_per_rank"] = [r["by_group"] for r in per_rank]
        if "error" in self.prediction:
            out["prediction_notes"] = [self.prediction["error"]]
        return {"comm": out}
