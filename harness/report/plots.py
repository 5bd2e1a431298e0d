"""The report's PNGs. Each plot function returns the labels of the series it drew (report.md lists them,
tests check them); a plot with nothing to show is not written and returns no labels."""

from __future__ import annotations

from pathlib import Path

from harness.config.objectives import readout_of

TERM_COLORS = {"params": "#4c72b0", "grads": "#dd8452", "fp32_grads": "#c44e52", "fp32_master": "#55a868",
               "optimizer_moments": "#8172b3", "reduce_buckets": "#937860", "gathered_params": "#da8bc3",
               "offload_buffers": "#8c8c8c", "other": "#ccb974"}
MB = 1e6


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path, ax_list) -> list[str]:
    labels = []
    for ax in ax_list:
        handles, names = ax.get_legend_handles_labels()
        if names and ax.get_legend() is None:
            ax.legend(fontsize=8)
        labels += names
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    _pyplot().close(fig)
    return labels


def plot_loss(run, path: Path) -> list[str]:
    """Not for an RL run: its loss sits near 0 while its gradient does not (rl_reward.png is its curve)."""
    if not run.train or "loss" not in readout_of(run.recipe).step:
        return []
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in run.train], [r["loss"] for r in run.train], label="train loss")
    if run.eval:
        ax.plot([r["step"] for r in run.eval], [r["eval_loss"] for r in run.eval], "o", label="eval loss")
    ax.set(xlabel="step", ylabel="loss", title="Loss")
    return _save(fig, path, [ax])


def _shade_window(ax, run) -> None:
    window = run.summary.get("profile", {}).get("window")
    if window:
        ax.axvspan(window[0] - 0.5, window[1] + 0.5, color="grey", alpha=0.15, label="profiled steps")


def plot_throughput(run, path: Path) -> list[str]:
    rows = [r for r in run.train if r.get("tokens_per_s")]
    if not rows:
        return []
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in rows], [r["tokens_per_s"] for r in rows], marker=".", label="tokens/s")
    _shade_window(ax, run)
    t = run.summary.get("throughput", {})
    mfu = f"MFU {100 * t['mfu']:.1f}%" if t.get("mfu") is not None else "MFU n/a on this device"
    ax.set(xlabel="step", ylabel="tokens/s (all ranks)", title=f"Throughput ({mfu})")
    ax.set_ylim(bottom=0)
    return _save(fig, path, [ax])


def _state_bars(ax, tables: dict) -> None:
    rows = [r for r in tables["states"] if r["term"] != "total"]
    n_ranks = max((len(r["measured"]) for r in rows), default=0)
    columns = ["predicted"] + [f"rank {i}" for i in range(n_ranks)]
    bottoms = [0.0] * len(columns)
    for r in rows:
        values = [(r["predicted"] or 0) / MB] + [m / MB for m in r["measured"]]
        ax.bar(columns, values, bottom=bottoms, color=TERM_COLORS.get(r["term"]), label=r["term"])
        bottoms = [b + v for b, v in zip(bottoms, values)]
    ax.set(ylabel="MB per rank", title="Model states after a step")
    ax.set_xlim(-0.6, len(columns) + 0.9)  # room on the right for the legend
    ax.legend(fontsize=8, loc="upper right")


def _process_memory(ax, run, tables: dict) -> None:
    rows = [r for r in run.train if r.get("memory")]
    key = "peak_allocated_bytes" if "peak_allocated_bytes" in rows[0]["memory"] else "peak_rss_bytes"
    ax.plot([r["step"] for r in rows], [r["memory"][key] / MB for r in rows], label=f"rank 0 {key[:-6]}")
    profiled = [r for r in rows if r.get("memory_per_rank")]
    for rank in range(1, max((len(r["memory_per_rank"]) for r in profiled), default=0)):
        ax.plot([r["step"] for r in profiled], [r["memory_per_rank"][rank][key] / MB for r in profiled], "o",
                label=f"rank {rank} {key[:-6]} (profiled)")
    predicted = tables["peak"][0]["predicted"] if tables["peak"] else None
    if predicted and key == "peak_allocated_bytes":
        ax.axhline(predicted / MB, color="red", linestyle="--", label="predicted peak")
    ax.set(xlabel="step", ylabel="MB", title="Peak memory per step")
    ax.set_ylim(bottom=0)


def plot_memory(run, tables: dict, path: Path) -> list[str]:
    has_states = bool(tables["states"])
    has_process = any(r.get("memory") for r in run.train)
    if not (has_states or has_process):
        return []
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    if has_states:
        _state_bars(axes[0], tables)
    if has_process:
        _process_memory(axes[1], run, tables)
    return _save(fig, path, axes)


def plot_comm(run, tables: dict, path: Path) -> list[str]:
    rows = tables["comm"]
    if not rows:
        return []
    plt = _pyplot()
    n_ranks = max(len(r["measured"]) for r in rows)
    width = 0.8 / (n_ranks + 1)
    fig, ax = plt.subplots(figsize=(max(6, 2 * len(rows)), 4.5))
    xs = range(len(rows))
    ax.bar([x - 0.4 + width / 2 for x in xs], [(r["predicted"] or 0) / MB for r in rows], width,
           color="lightgrey", edgecolor="black", label="predicted")
    for rank in range(n_ranks):
        ax.bar([x - 0.4 + width * (rank + 1.5) for x in xs],
               [r["measured"][rank] / MB if rank < len(r["measured"]) else 0 for r in rows], width,
               label=f"rank {rank}")
    ax.set_xticks(list(xs), [r["collective"] for r in rows], rotation=15)
    ax.set(ylabel="MB per step (logged bytes)", title="Communication per collective")
    return _save(fig, path, [ax])


TIMER_PARTS = (("fwd_ms", "forward"), ("bwd_inner_ms", "backward compute"),
               ("bwd_allreduce_ms", "backward reduce"), ("step_ms", "optimizer step"))


def plot_step_time(run, path: Path) -> list[str]:
    rows = [r for r in run.train if r.get("step_time_s")]
    if not rows:
        return []
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    steps = [r["step"] for r in rows]
    bottoms = [0.0] * len(rows)
    if any("fwd_ms" in r for r in rows):
        for key, label in TIMER_PARTS:
            values = [r.get(key, 0.0) for r in rows]
            ax.bar(steps, values, bottom=bottoms, label=label)
            bottoms = [b + v for b, v in zip(bottoms, values)]
        rest = [max(0.0, 1000 * r["step_time_s"] - b) for r, b in zip(rows, bottoms)]
        ax.bar(steps, rest, bottom=bottoms, color="lightgrey", label="other (data to device, engine bookkeeping)")
    ax.plot(steps, [1000 * r["step_time_s"] for r in rows], "k.-", label="step time")
    ax.set(xlabel="step", ylabel="ms", title="Step time breakdown (rank 0)")
    return _save(fig, path, [ax])


def plot_preference(run, path: Path) -> list[str]:
    """A preference run (train.objective dpo / ipo / simpo / orpo): the reward margin and the pairs ranked right."""
    rows = [r for r in run.train if r.get("rewards_margin") is not None]
    if not rows:
        return []
    plt = _pyplot()
    fig, margin = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in rows]
    margin.plot(steps, [r["rewards_margin"] for r in rows], color="#4c72b0", label="reward margin (chosen - rejected)")
    margin.set(xlabel="step", ylabel="reward margin", title="Preference: reward margin and accuracy")
    accuracy = margin.twinx()
    accuracy.plot(steps, [r["rewards_accuracy"] for r in rows], color="#dd8452", label="reward accuracy")
    accuracy.set(ylabel="accuracy (chosen > rejected)", ylim=(-0.05, 1.05))
    return _save(fig, path, [margin, accuracy])


def plot_sources(run, path: Path) -> list[str]:
    """A mixture (train.datasets): each source's train loss (lines) and eval loss (dots), and its share of the rows
    read so far."""
    names = sorted({k[len("rows/"):] for r in run.train for k in r if k.startswith("rows/")})
    if not names:
        return []
    plt = _pyplot()
    fig, (loss_ax, share_ax) = plt.subplots(1, 2, figsize=(11, 4))
    totals = {name: 0 for name in names}
    shares = {name: [] for name in names}
    for r in run.train:
        for name in names:
            totals[name] += r.get(f"rows/{name}", 0)
        for name in names:
            shares[name].append(totals[name] / max(1, sum(totals.values())))
    steps = [r["step"] for r in run.train]
    for name in names:
        points = [(r["step"], r[f"loss/{name}"]) for r in run.train if r.get(f"loss/{name}") is not None]
        line = loss_ax.plot(*zip(*points), label=f"loss/{name}") if points else None
        evals = [(r["step"], r[f"eval_loss/{name}"]) for r in run.eval if r.get(f"eval_loss/{name}") is not None]
        if evals:
            loss_ax.plot(*zip(*evals), "o", color=line[0].get_color() if line else None, label=f"eval_loss/{name}")
        share_ax.plot(steps, shares[name], label=f"rows/{name} share")
    loss_ax.set(xlabel="step", ylabel="mean token loss", title="Loss per source")
    share_ax.set(xlabel="step", ylabel="share of rows read", title="Rows read per source", ylim=(0, 1))
    return _save(fig, path, [loss_ax, share_ax])


def write_all(run, tables: dict, out_dir: Path) -> dict[str, list[str]]:
    """Write every plot that has data; {file name: series labels}."""
    out = {}
    for name, draw in (("loss.png", lambda p: plot_loss(run, p)),
                       ("throughput.png", lambda p: plot_throughput(run, p)),
                       ("memory.png", lambda p: plot_memory(run, tables, p)),
                       ("comm.png", lambda p: plot_comm(run, tables, p)),
                       ("step_time.png", lambda p: plot_step_time(run, p)),
                       ("preference.png", lambda p: plot_preference(run, p)),
                       ("sources.png", lambda p: plot_sources(run, p))):
        labels = draw(Path(out_dir) / name)
        if labels:
            out[name] = labels
    return out
