"""The planner's prediction for one run: `evaluate(run, cluster, profile, live)` (harness.planner.evaluate).

The run is the RunModel the launch trains (config/run_model.py). Its layout is evaluated by the same code
`harness plan` uses (layouts.evaluate, then steptime.step_time on a hardware profile), so the step time a run
predicts for itself is the one the plan would print for that layout. With the facts only a live engine knows
(rank.LiveFacts, read by profiling/live.py) it also predicts this rank's own bytes (rank.py), the numbers the
report sets beside what the hooks measured.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.config.run_model import RunModel
from harness.planner import layouts, rank, steptime
from harness.planner.inputs import Cluster
from harness.planner.params import count_params, model_shape


@dataclass(frozen=True)
class Prediction:
    rank: dict | None = None  # this rank's model states, activations and comm bytes (given live facts)
    layout: dict | None = None  # layouts.evaluate of the run's layout on the cluster: what `harness plan` shows
    time: dict | None = None  # steptime.step_time of that layout on the hardware profile


def candidate(run: RunModel) -> layouts.Candidate:
    """The planner's layout of this run."""
    z, d, seq = run.zero, run.degrees, run.sequence
    opt = "cpu" if z.stage < 3 and z.offload_optimizer == "nvme" else z.offload_optimizer  # stages 1-2: nvme is cpu
    recipe = "3d" if d.pp > 1 and d.tp > 1 else "pipeline" if d.pp > 1 else "tp" if d.tp > 1 else "zero"
    act = "offload" if seq.activation_offload else ""  # tiling alone keeps the run's checkpointing
    return layouts.Candidate(recipe, z.stage, opt, z.offload_param, d.tp, d.pp, d.sp, seq.tiled_mlp, act, d.ep)


def evaluate(run: RunModel, cluster: Cluster | None = None, profile: dict | None = None,
             live: rank.LiveFacts | None = None) -> Prediction:
    """Memory per rank and comm per step of the run's layout on `cluster` (layouts.hardware), its step time on
    `profile` (planner/hardware.py), and with `live` this rank's own prediction (a pipeline rank's by its stage).

    The step time counts the base model (not a LoRA run's adapters), as the run's predictions always have."""
    own = None
    if live is not None:
        own = rank.pipeline_rank(run, live) if run.degrees.pp > 1 else rank.rank_prediction(run, live)
    if cluster is None:
        return Prediction(rank=own)
    cfg = dict(run.model_config)
    c, count, shape, work = candidate(run), count_params(cfg), model_shape(cfg), rank.workload(run)
    result = layouts.evaluate(c, count, shape, cluster, work)
    time = steptime.step_time(c, count, shape, profile, cluster, work, result) if profile is not None else None
    return Prediction(rank=own, layout=result, time=time)
