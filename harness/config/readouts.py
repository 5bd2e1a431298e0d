"""What the user of each objective watches, declared once: the metrics of the `[step]` console line, of the `[done]`
line (first -> last), of summary.json's "readouts", of the report's headline and of the trackers (W&B, MLflow,
DeepSpeed's monitors). The objective registry (harness/config/objectives.py) names a readout per objective; the
trainer, the run's summary, the report and the trackers ask `readout_of(recipe)` and never list names of their own.

A name is a train record's key in metrics.jsonl (TRL's where TRL has one); a name ending in "/" stands for every key
under it (a mixture's loss/<source>). A metric a step did not log (kl with rl.beta 0, the clip ratios under sapo) is
left out of that line. `window` > 1: `[done]`, the summary and the headline compare the mean of the first and of the
last `window` steps (at most half the steps each), where one step is noise (an RL reward over one batch of groups).

The objectives that land next plug in by one declaration each, e.g. in objectives.py:

    Objective("grpo_tools", "rl", ..., readout=Readout(step=(*RL.step, "tools/call_frequency"), done=RL.done,
                                                        window=RL.window, section="rl"))

Pure: no torch, no engine. May import: the ground floor.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Readout:
    step: tuple[str, ...]  # the [step] line's metrics, in order (lr, grad_norm and tokens/s follow on every line)
    done: tuple[str, ...]  # [done], summary.json "readouts", the report headline: first -> last
    window: int = 1  # steps averaged at each end of `done`
    tracked: tuple[str, ...] = ()  # further names for the trackers (step and done are always sent)
    section: str | None = None  # the report's own section and plots: "rl" | "preference" | None


LM = Readout(step=("loss",), done=("loss",))
MIXTURE = Readout(step=("loss",), done=("loss", "loss/"), tracked=("rows/",))  # an lm run over train.datasets
PREFERENCE = Readout(step=("loss", "rewards_margin", "rewards_accuracy"),
                     done=("loss", "rewards_margin", "rewards_accuracy"),
                     tracked=("rewards_chosen", "rewards_rejected", "logps_chosen", "logps_rejected"),
                     section="preference")
REWARD_MODEL = Readout(step=("loss", "rewards_accuracy", "rewards_margin"),
                       done=("loss", "rewards_accuracy", "rewards_margin"),
                       tracked=("rewards_chosen", "rewards_rejected"), section="preference")
RL = Readout(step=("reward", "reward_std", "completions/mean_length", "kl", "clip_ratio/region_mean",
                   "cispo_clip_ratio"),
             done=("reward", "completions/mean_length"), window=3,
             tracked=("loss", "rewards/", "frac_reward_zero_std", "completions/", "entropy", "clip_ratio/",
                      "time/", "step_tokens", "sample/", "sampling/"),
             section="rl")
DISTILL = Readout(step=("loss", "entropy", "teacher_entropy", "completions/mean_length"), done=("loss",),
                  tracked=("num_tokens", "completions/", "time/"))  # gkd, distill (harness/train/distill.py)
# time/<part>: the step's split (rl/grpo); tools_s: a multi-turn loop's time outside its generate calls
RL_TIMES = ("generate_s", "tools_s", "score_s", "reference_s", "train_s", "sync_s")


def names(pattern: str, record: dict) -> list[str]:
    """The record's keys a declared name stands for (itself, or every key under a "name/" prefix), logged values
    only."""
    if pattern.endswith("/"):
        return sorted(k for k, v in record.items() if k.startswith(pattern) and v is not None)
    return [pattern] if record.get(pattern) is not None else []


def keys(patterns: tuple[str, ...], record: dict) -> list[str]:
    """The record's keys the declared names stand for, each once (a name and a prefix over it: completions/)."""
    return list(dict.fromkeys(k for p in patterns for k in names(p, record)))


def value_text(value: float) -> str:
    return f"{value:.4f}" if abs(value) < 1e4 else f"{value:.4g}"


def step_text(readout: Readout, record: dict) -> str:
    """The [step] line's metrics: "reward 0.2610 reward_std 0.1180 completions/mean_length 7.5000"."""
    return " ".join(f"{k} {value_text(record[k])}" for k in keys(readout.step, record))


def ends(readout: Readout, records: list[dict]) -> dict[str, dict]:
    """{name: {"first", "last", "steps"}} over the train records of `done`, "steps" = how many steps each end
    averages (the first and the last `window` with a value, at most half of them)."""
    out = {}
    for pattern in readout.done:
        for key in sorted({k for r in records for k in names(pattern, r)}):
            out[key] = end_means([r[key] for r in records if r.get(key) is not None], readout.window)
    return out


def end_means(values: list[float], window: int) -> dict:
    """{"first", "last", "steps"}: the means of the first and of the last `window` values (at most half each)."""
    k = max(1, min(window, len(values) // 2))
    return {"first": sum(values[:k]) / k, "last": sum(values[-k:]) / k, "steps": k}


def ends_text(found: dict[str, dict]) -> str:
    """"reward 0.2610 -> 0.4520, completions/mean_length 8.0000 -> 5.2500 (means of the first and last 3 steps)"."""
    text = ", ".join(f"{key} {value_text(e['first'])} -> {value_text(e['last'])}" for key, e in found.items())
    window = max((e["steps"] for e in found.values()), default=1)
    return (text + (f" (means of the first and last {window} steps)" if window > 1 else "")) or "no step logged"


def tracked(readout: Readout) -> tuple[str, ...]:
    return tuple(dict.fromkeys((*readout.step, *readout.done, *readout.tracked)))
