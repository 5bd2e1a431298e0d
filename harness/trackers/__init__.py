"""Experiment trackers (recipe `monitor.wandb`, `monitor.mlflow`) beside DeepSpeed's TensorBoard and CSV monitors.

Why the harness's own calls through the wandb and mlflow Python APIs, not DeepSpeed 0.19.8's WandbMonitor
(deepspeed/monitor/wandb.py):
  - DeepSpeed has no MLflow monitor: one code path logs the same names to both trackers.
  - WandbMonitor calls wandb.init(project, group, entity) inside deepspeed.initialize, on rank 0 alone, with no mode,
    dir, name or config: a run could not go offline into its run folder nor carry its recipe, and a start that
    fails raises on rank 0 while the other ranks wait in a collective.
  - it logs each event in a wandb.log of its own with step = global samples; memory per rank, the predicted step
    time and the run's parameters need the harness's own calls anyway.
The libraries behind one small interface: backends.py.

May import: the ground floor, config/, profiling/ (the names of the fields its hooks record).

Lifecycle (harness/train/job.py): `start` right after the run folder is written, before the data, model and engine
(collective: every rank calls it). Only rank 0 talks to a tracker, so only rank 0 checks and starts them, and
tells every rank the outcome: a tracker that cannot start (package missing, wandb online without a login, a server
that does not answer, the library's own refusal) makes every rank exit 2 with the key and the fix, or with
`monitor.<tracker>.best_effort` a warning line, and the run trains without it. Checking on every rank before the
process group, as the other machine checks do, would refuse a multi-node job whose other nodes have no login or
no route to the server, which they never need. Mid-run, a tracker call that raises is caught: one warning line,
that tracker is off for the rest of the run, training goes on. `finish` in job.run's finally: exit code 0 (a
finished run), 75 (preempted) or 1 (an error).

What is logged, x axis = the step as in metrics.jsonl (1-based), the same names in both trackers:
  train/loss, train/lr, train/grad_norm, train/tokens_per_s, train/samples_per_s, train/step_time_s (measured),
  train/step_time_predicted_s (planner, for this machine), train/tflops_per_gpu, train/mfu (only where the device
  has a known peak: null on CPU is not logged), timers/{fwd,bwd,bwd_inner,bwd_allreduce,step}_ms (profile window)
  train/<name> for every name an objective watches (harness/config/readouts.py), as metrics.jsonl spells it:
    preference train/{rewards_chosen,rewards_rejected,rewards_margin,rewards_accuracy,logps_chosen,logps_rejected};
    GRPO train/{reward,reward_std,rewards/<fn>/mean,frac_reward_zero_std,completions/mean_length,kl,entropy,
    clip_ratio/region_mean,time/generate_s,...} (TRL's own W&B names: its Trainer prefixes train/ too)
  eval/loss (+ eval/{the six above} of a preference run)  at each evaluation
  train/loss/<name>, train/rows/<name>, eval/loss/<name>  (a mixture's sources, train.datasets)
  memory/rank{R}/{field}_bytes               rank 0 every step; every rank on the profiled steps
                                             (profiling/memory.py gathers them there only: no collective on other steps)
  at the end (wandb: run summary; MLflow: metrics at the last step): summary/{first_loss, last_loss, eval_loss,
  tokens_per_s_median, tflops_per_gpu, mfu}, summary/<name>/{first,last} of the objective's [done] line (summary.json
  "readouts": summary/reward/first, summary/rewards_accuracy/last ...), step_time/predicted_s, step_time/measured_median_s/rank{R},
  step_time/ratio, memory/peak/rank{R}/{field}_bytes, memory/predicted_peak_total_bytes/rank{R}
Parameters: {"recipe": the resolved recipe, "ds_config": what deepspeed.initialize got, "run": world size,
degrees, run folder} (wandb: the run config as nested blocks; MLflow: flattened, "recipe.train.steps" = "8",
strings as they are, other values as JSON). Every string passes harness.errors.without_secrets first, as does
every message: no API key or token reaches a parameter, a log line or an error.
"""

from __future__ import annotations

import math
from pathlib import Path

from harness.config.defaults import PREFERENCE_METRICS
from harness.config.objectives import all_tracked
from harness.config.readouts import keys as readout_keys
from harness.config.validate import strip_annotations
from harness.errors import ConfigError, Problem, without_secrets
from harness.log import say
from harness.profiling.throughput import TIMERS
from harness.trackers.backends import BACKENDS, shown

TRAIN = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm", "tokens_per_s": "train/tokens_per_s",
         "samples_per_s": "train/samples_per_s", "step_time_s": "train/step_time_s",
         "tflops_per_gpu": "train/tflops_per_gpu", "mfu": "train/mfu",
         **{f"{name}_ms": f"timers/{name}_ms" for name in TIMERS}}
WATCHED = all_tracked()  # what some objective's user watches: train/<name> (mixture's loss/<source> included)
PREEMPTED = 75


def enabled(recipe: dict) -> dict[str, dict]:
    """{tracker: its recipe block} for the trackers the recipe turns on, in a fixed order."""
    monitor = recipe.get("monitor", {})
    return {name: monitor[name] for name in BACKENDS if (monitor.get(name) or {}).get("enabled")}


def number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def scrubbed(tree):
    """`tree` with every string through without_secrets and URLs without their user:password (parameters a tracker
    stores)."""
    if isinstance(tree, dict):
        return {k: scrubbed(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [scrubbed(v) for v in tree]
    return without_secrets(shown(tree) if "://" in tree else tree) if isinstance(tree, str) else tree


def run_params(spec, run_dir: Path) -> dict:
    run = {"recipe_name": spec.recipe_name, "world_size": spec.world_size, "dp": spec.dp, "tp": spec.tp,
           "pp": spec.pp, "run_dir": str(Path(run_dir).absolute())}
    blocks = {"recipe": spec.recipe, "ds_config": spec.ds_config}  # without "$schema": a file reference, no setting
    return scrubbed({**{name: strip_annotations(block) for name, block in blocks.items()}, "run": run})


class Trackers:
    """Rank 0's running trackers (empty elsewhere). Every call is guarded: a tracker that raises is reported once
    and dropped, the others and the training go on."""

    def __init__(self, runs: list | None = None):
        self.runs = list(runs or [])
        self.wandb_started = any(run.name == "wandb" for run in self.runs)

    def __bool__(self) -> bool:
        return bool(self.runs)

    def _each(self, what: str, call) -> None:
        for run in list(self.runs):
            try:
                call(run)
            except Exception as e:
                self.runs.remove(run)
                why = " ".join(str(e).split())[:300]
                after = "" if what == "finish" else f"; {run.name} is off for the rest of this run, training goes on"
                say("track", without_secrets(f"warning: {run.name} {what} failed ({type(e).__name__}: {why}){after}"))

    def log(self, step: int, metrics: dict) -> None:
        if metrics:
            self._each(f"logging at step {step}", lambda run: run.log(step, metrics))

    def summary(self, values: dict, step: int) -> None:
        if values:
            self._each("summary", lambda run: run.summary(values, step))

    def hook(self, dist, predicted_step_s: float | None) -> "TrackerHook":
        """The profiling hook that sends each logged record here. Made here, not in profiling/: that room sits
        below this one and never imports it."""
        return TrackerHook(self, dist, predicted_step_s)

    def finish(self, exit_code: int) -> None:
        self._each("finish", lambda run: run.finish(exit_code))
        self.runs = []
        if self.wandb_started:  # stop wandb's service process now: the rank ends through os._exit
            self.wandb_started = False
            try:
                import wandb

                wandb.teardown(exit_code)
            except Exception:
                pass


def _start_one(name: str, cfg: dict, run_dir: Path, params: dict):
    """(the started run, None) or (None, Problem)."""
    backend = BACKENDS[name]
    found = backend.problem(cfg, run_dir)
    if found is None:
        try:
            return backend(cfg, run_dir, cfg["run_name"] or Path(run_dir).name, params), None
        except Exception as e:
            why = " ".join(str(e).split())[:500]
            found = (f"monitor.{name}", f"{name} could not start ({type(e).__name__}: {why})",
                     f"--set monitor.{name}.enabled=false")
    path, message, fix = found
    if not cfg["best_effort"]:
        fix += f"; or --set monitor.{name}.best_effort=true to train without it"
    return None, Problem(path, without_secrets(message), without_secrets(fix),
                         "warning" if cfg["best_effort"] else "error")


def start(spec, dist, run_dir: Path) -> Trackers:
    """Start the recipe's trackers on rank 0; every rank raises ConfigError (exit 2) when one that is not
    best-effort could not start. A collective when any tracker is on (the recipe is the same on every rank)."""
    from harness import dist as distmod

    wanted = enabled(spec.recipe)
    if not wanted:
        return Trackers()
    runs, problems = [], []
    if dist.is_main:
        params = run_params(spec, run_dir)
        for name, cfg in wanted.items():
            run, problem = _start_one(name, cfg, run_dir, params)
            runs += [run] if run else []
            problems += [problem] if problem else []
    trackers = Trackers(runs)
    problems = distmod.broadcast_object(problems) if dist.world_size > 1 else problems
    errors = [p for p in problems if p.severity == "error"]
    if errors:
        trackers.finish(2)
        raise ConfigError(errors, "trackers")
    if dist.is_main:
        for p in problems:
            say("track", f"warning: {p.render()}\n    best_effort: training goes on without it")
        for run in trackers.runs:
            say("track", f"{run.name}: {run.where}")
    return trackers


SOURCE_EVAL = "eval_loss/"  # eval/loss/<name>


def step_metrics(kind: str, record: dict, predicted_step_s: float | None) -> dict[str, float]:
    """One trainer record ("train" or "eval") -> {metric name: value}; values that are not finite numbers
    (mfu on CPU) are left out."""
    if kind == "eval":
        out = {"eval/loss": number(record.get("eval_loss")),
               **{f"eval/{name}": number(record.get(f"eval_{name}")) for name in PREFERENCE_METRICS},
               **{f"eval/{key[len('eval_'):]}": number(v) for key, v in record.items() if key.startswith(SOURCE_EVAL)}}
        return {k: v for k, v in out.items() if v is not None}
    if kind != "train":
        return {}
    out = {TRAIN[field]: number(record.get(field)) for field in TRAIN}
    out["train/step_time_predicted_s"] = number(predicted_step_s)
    out.update({f"train/{key}": number(record[key]) for key in readout_keys(WATCHED, record)})
    per_rank = record.get("memory_per_rank") or ([record["memory"]] if record.get("memory") else [])
    for rank, memory in enumerate(per_rank):
        out.update({f"memory/rank{rank}/{key}": number(value) for key, value in (memory or {}).items()})
    return {k: v for k, v in out.items() if v is not None}


def summary_metrics(summary: dict) -> dict[str, float]:
    """summary.json -> the run's end values (names in the module docstring)."""
    throughput = summary.get("throughput") or {}
    step_time = throughput.get("step_time") or {}
    memory = summary.get("memory") or {}
    out = {f"summary/{k}": number(summary.get(k)) for k in ("first_loss", "last_loss", "eval_loss")}
    out.update({f"summary/{k}": number(throughput.get(k)) for k in ("tokens_per_s_median", "tflops_per_gpu", "mfu")})
    for name, ends in (summary.get("readouts") or {}).items():  # the [done] line's first -> last
        out.update({f"summary/{name}/{end}": number(ends.get(end)) for end in ("first", "last")})
    out["step_time/predicted_s"] = number(step_time.get("step_time_s"))
    out["step_time/ratio"] = number(step_time.get("ratio"))
    for rank, seconds in enumerate(step_time.get("measured_median_s_per_rank") or []):
        out[f"step_time/measured_median_s/rank{rank}"] = number(seconds)
    for rank, peaks in enumerate(memory.get("peak_per_rank") or []):
        out.update({f"memory/peak/rank{rank}/{k}": number(v) for k, v in (peaks or {}).items()})
    for rank, nbytes in enumerate(memory.get("predicted_peak_total_per_rank") or []):
        out[f"memory/predicted_peak_total_bytes/rank{rank}"] = number(nbytes)
    return {k: v for k, v in out.items() if v is not None}


class TrackerHook:
    """Profiling hook (harness/profiling/__init__.py's contract): each logged record to the trackers, rank 0."""

    def __init__(self, trackers: Trackers, dist, predicted_step_s: float | None):
        self.trackers, self.dist, self.predicted_step_s = trackers, dist, predicted_step_s

    def before_step(self, step: int) -> None:
        pass

    def after_step(self, step: int) -> None:
        return None

    def on_record(self, kind: str, step: int, record: dict) -> None:
        if self.dist.is_main and self.trackers:
            self.trackers.log(step, step_metrics(kind, record, self.predicted_step_s))

    def close(self) -> None:
        return None
