"""The planner: memory and communication math per strategy, and the seeds' decision order.

Pure: imports neither torch nor deepspeed (the exact meta-device count in params.py imports them
lazily). `plan(...)` is what `harness plan` and `harness/run.py --recipe auto` call.

May import: the ground floor, config/."""

from harness.planner.decide import Plan, plan

__all__ = ["Plan", "plan"]
