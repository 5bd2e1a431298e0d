"""The planner: memory and communication math per strategy, and the decision order (DDP -> ZeRO-1/2 -> ZeRO-3 ->
offload -> TP in a node -> pipeline/3D -> the long-context rung).

Pure: imports neither torch nor deepspeed (the exact meta-device count in params.py imports them
lazily). `plan(...)` is what `harness plan` and `harness/run.py --recipe auto` call; `evaluate(run, ...)` is a
run's prediction of itself (planner/prediction.py).

May import: the ground floor, config/."""

from harness.planner.decide import Plan, plan
from harness.planner.prediction import Prediction, evaluate

__all__ = ["Plan", "Prediction", "evaluate", "plan"]
