"""The report's part that is the objective's own (harness/config/readouts.py says what its user watches): the
headline's lengths and first -> last, and a section per family beside the memory and traffic ones.

- rl (GRPO): the prompt and completion lengths (recipe limits, and measured: prompts from rollouts.jsonl, completions
  from completions/*), a table of reward, reward_std, frac_reward_zero_std, completion lengths, KL, entropy and the
  clip ratios (first and last window, min, max), and the step's time split (time/generate_s ... sync_s: median
  seconds and share); plots in objective_plots.py.
- preference (dpo and kin, reward models): the loss, margins, accuracies and rewards per side, first and last, and
  the last evaluation's; the margin / accuracy plot (plots.py).
Pure but for reading rollouts.jsonl.
"""

from __future__ import annotations

import json
import statistics

from harness.config.objectives import readout_of
from harness.config.readouts import RL_TIMES, end_means, ends, ends_text, keys, value_text
from harness.report.tables import table

RL_ROWS = ("reward", "reward_std", "rewards/", "frac_reward_zero_std", "completions/mean_length",
           "completions/min_length", "completions/max_length", "completions/clipped_ratio",
           "completions/mean_terminated_length", "kl", "entropy", "clip_ratio/", "cispo_clip_ratio")
PREFERENCE_ROWS = ("loss", "rewards_margin", "rewards_accuracy", "rewards_chosen", "rewards_rejected",
                   "logps_chosen", "logps_rejected")


def prompt_lengths(run) -> list[int]:
    """Token count of each logged completion's prompt (rollouts.jsonl); [] without the file."""
    path = run.path / "rollouts.jsonl"
    if not path.exists():
        return []
    return [len(json.loads(line)["prompt_ids"]) for line in path.read_text().splitlines() if line.strip()]


def lengths(run) -> str:
    """The header's lengths: an RL run's prompts and completions, seq_len otherwise."""
    train = run.recipe.get("train", {})
    if readout_of(run.recipe).section != "rl":
        return f"seq_len {train.get('seq_len', '?')}"
    rl = run.recipe.get("rl", {})
    prompts = prompt_lengths(run)
    seen = f" (measured mean {statistics.mean(prompts):.1f}, max {max(prompts)})" if prompts else ""
    done = [r["completions/mean_length"] for r in run.train if r.get("completions/mean_length") is not None]
    made = f" (measured mean {statistics.mean(done):.1f})" if done else ""
    return (f"prompts of at most {rl.get('max_prompt_length', '?')} tokens{seen}, completions of at most "
            f"{rl.get('max_completion_length', '?')}{made}, {rl.get('num_generations', '?')} per prompt")


def steps_line(run) -> str:
    """The headline's "N steps logged: reward 0.2200 -> 0.4100, ..." (the [done] line's metrics, whole run)."""
    text = f"- {len(run.train)} steps logged: {ends_text(ends(readout_of(run.recipe), run.train))}"
    return text + (f", eval loss {run.eval[-1]['eval_loss']:.4f}" if run.eval else "")


def metric_rows(run, patterns: tuple[str, ...], window: int) -> list[dict]:
    """{name, first, last, steps, min, max} per logged name (first / last: means of `window` steps at each end)."""
    rows = []
    for key in dict.fromkeys(k for r in run.train for k in keys(patterns, r)):
        values = [r[key] for r in run.train if r.get(key) is not None]
        rows.append({"name": key, **end_means(values, window), "min": min(values), "max": max(values)})
    return rows


def time_split(run) -> list[dict]:
    """The RL step's parts: {part, median_s, share} (share of the parts' summed medians)."""
    medians = {}
    for part in RL_TIMES:
        values = [r[f"time/{part}"] for r in run.train if r.get(f"time/{part}") is not None]
        if values:
            medians[part] = statistics.median(values)
    total = sum(medians.values()) or 1.0
    return [{"part": p, "median_s": s, "share": s / total} for p, s in medians.items()]


def section_tables(run) -> dict:
    """report.json's "objective": the rows the section shows."""
    readout = readout_of(run.recipe)
    if readout.section == "rl":
        return {"section": "rl", "metrics": metric_rows(run, RL_ROWS, readout.window), "time_split": time_split(run)}
    if readout.section == "preference":
        return {"section": "preference", "metrics": metric_rows(run, PREFERENCE_ROWS, readout.window)}
    return {}


def _metric_table(rows: list[dict]) -> str:
    return table(["metric", "first", "last", "min", "max"],
                 [[r["name"], value_text(r["first"]), value_text(r["last"]), value_text(r["min"]),
                   value_text(r["max"])] for r in rows])


def objective_section(run, tables: dict) -> list[str]:
    if not tables.get("metrics"):
        return []
    objective = run.recipe.get("train", {}).get("objective", "lm")
    window = max(r["steps"] for r in tables["metrics"])
    per = f" (first / last: means of the first and last {window} steps)" if window > 1 else ""
    if tables["section"] == "preference":
        out = ["", f"## Preference: margins and accuracies ({objective})", "",
               f"Per step, the mean over the step's pairs and ranks{per}; plot preference.png.", "",
               _metric_table(tables["metrics"])]
        if run.eval:
            last = run.eval[-1]
            shown = [k for k in ("eval_loss", *(f"eval_{n}" for n in PREFERENCE_ROWS[1:])) if last.get(k) is not None]
            out += ["", f"Last evaluation (step {last['step']}): "
                    + ", ".join(f"{k} {value_text(last[k])}" for k in shown)]
        return out
    out = ["", f"## RL: reward, completions and the policy ({objective})", "",
           f"- {lengths(run)}",
           f"- per step, over the step's completions (TRL's names){per}; plots rl_reward.png, rl_policy.png", "",
           _metric_table(tables["metrics"])]
    if tables["time_split"]:
        out += ["", "The step's time split (rank 0, median seconds per step; plot rl_time.png):", "",
                table(["part", "median s", "share"], [[r["part"], f"{r['median_s']:.4f}", f"{r['share']:.0%}"]
                                                      for r in tables["time_split"]])]
    return out
