"""An RL run's plots (harness/report/objective.py has its tables): what the report draws is `rl_series(run)`, per
plot file {series label: (steps, values)}, so a test can hold the drawn numbers against metrics.jsonl.

  rl_reward.png  reward (mean, with a +- reward_std band), completion lengths (mean, min, max) and the share of
                 groups with zero reward spread (frac_reward_zero_std: no advantage, no gradient)
  rl_policy.png  KL (beta > 0), entropy and the clip ratios (whichever the loss type logs)
  rl_time.png    the step's time split, stacked: time/generate_s, score_s, reference_s, train_s, sync_s
"""

from __future__ import annotations

from pathlib import Path

from harness.config.readouts import RL_TIMES, keys
from harness.report.plots import _pyplot, _save

REWARD = ("reward", "reward_std")
LENGTHS = ("completions/mean_length", "completions/min_length", "completions/max_length")
POLICY = ("kl", "entropy", "clip_ratio/", "cispo_clip_ratio")


def _series(run, patterns) -> dict[str, tuple[list[int], list[float]]]:
    out = {}
    for key in dict.fromkeys(k for r in run.train for k in keys(patterns, r)):
        points = [(r["step"], r[key]) for r in run.train if r.get(key) is not None]
        out[key] = ([s for s, _ in points], [v for _, v in points])
    return out


def rl_series(run) -> dict[str, dict[str, tuple[list[int], list[float]]]]:
    """{plot file: {series: (steps, values)}}; empty for a run that logged no reward."""
    if not any(r.get("reward") is not None for r in run.train):
        return {}
    return {"rl_reward.png": _series(run, (*REWARD, *LENGTHS, "frac_reward_zero_std")),
            "rl_policy.png": _series(run, POLICY),
            "rl_time.png": _series(run, tuple(f"time/{p}" for p in RL_TIMES))}


def plot_reward(series: dict, path: Path) -> list[str]:
    plt = _pyplot()
    fig, (reward_ax, length_ax, zero_ax) = plt.subplots(1, 3, figsize=(15, 4))
    steps, mean = series["reward"]
    reward_ax.plot(steps, mean, marker=".", label="reward (mean)")
    if "reward_std" in series and series["reward_std"][0] == steps:
        std = series["reward_std"][1]
        reward_ax.fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                               alpha=0.25, label="reward +- reward_std")
    reward_ax.set(xlabel="step", ylabel="reward", title="Reward over the step's completions")
    for key in LENGTHS:
        if key in series:
            length_ax.plot(*series[key], marker="." if key.endswith("mean_length") else None, label=key)
    length_ax.set(xlabel="step", ylabel="tokens", title="Completion length")
    if "frac_reward_zero_std" in series:
        zero_ax.plot(*series["frac_reward_zero_std"], marker=".", color="#c44e52", label="frac_reward_zero_std")
    zero_ax.set(xlabel="step", ylabel="share of groups", ylim=(-0.05, 1.05),
                title="Groups with zero reward spread (no gradient)")
    return _save(fig, path, [reward_ax, length_ax, zero_ax])


def plot_policy(series: dict, path: Path) -> list[str]:
    if not series:
        return []
    plt = _pyplot()
    fig, (kl_ax, ratio_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for key, points in series.items():
        (kl_ax if key in ("kl", "entropy") else ratio_ax).plot(*points, marker=".", label=key)
    kl_ax.set(xlabel="step", ylabel="nats per token", title="KL to the reference, entropy")
    ratio_ax.set(xlabel="step", ylabel="share of loss tokens", title="Clip ratios")
    return _save(fig, path, [kl_ax, ratio_ax])


def plot_time(series: dict, path: Path) -> list[str]:
    if not series:
        return []
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    steps = sorted({s for xs, _ in series.values() for s in xs})
    bottoms = dict.fromkeys(steps, 0.0)
    for key, (xs, values) in series.items():
        ax.bar(xs, values, bottom=[bottoms[s] for s in xs], label=key)
        for s, v in zip(xs, values):
            bottoms[s] += v
    ax.set(xlabel="step", ylabel="seconds (rank 0)", title="The RL step's time split")
    return _save(fig, path, [ax])


def write_rl(run, out_dir: Path) -> dict[str, list[str]]:
    """Write an RL run's plots; {file name: series labels} of those drawn."""
    series, out = rl_series(run), {}
    for name, draw in (("rl_reward.png", plot_reward), ("rl_policy.png", plot_policy), ("rl_time.png", plot_time)):
        if name in series:
            labels = draw(series[name], Path(out_dir) / name)
            if labels:
                out[name] = labels
    return out
