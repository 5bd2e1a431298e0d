"""What the harness costs over a plain DeepSpeed loop: tokens/s of harness/run.py vs bench/raw_deepspeed.py.

    python bench/overhead.py [--pairs 3] [--steps 100] [--warmup-steps 5] [--recipe zero2] [--ranks 2]

Both train the same model on the same rows with the same resolved DeepSpeed config (raw_deepspeed.py reads
the ds_config.json and recipe.json the harness run wrote; with profiling on it drops the harness's
profiling keys, so the baseline is always DeepSpeed without profiling). Runs alternate (H R, R H, H R, ...)
so drift on a shared machine hits both sides; the verdict is the median of the per-pair ratios.
Variants: "off" (--profile-steps '') and "on" (the recipe's defaults: profile window 3-4, memory hook,
DeepSpeed's wall-clock timers on every step); the window's steps fall in the warm-up and are reported apart.
Steps of the tiny default model take ~60-100 ms on 2 CPU cores, so a few ms per step is a few per cent,
and 30 steps time only ~2 s: too short to see 2% through the noise of a shared machine (hence 100).

Counted for both: the steps after the first --warmup-steps, end to end on rank 0.
  harness        train records' "time" stamps (each step's end): every step with everything the harness does
                 around it (hooks, the loss all-reduce and records written at each flush, log lines). The headline.
  harness (own)  the records' step_time_s: the micro-batch loop only, as the harness reports itself.
  raw            perf_counter at step ends around forward / backward / step.
ratio is tokens/s over the timed steps (harness / raw); "median step" and "p20 step" compare the median and
20th-percentile step times instead, which a busy shared machine disturbs much less than the mean.
The losses of the two runs must agree step for step, which shows they did the same work.
Goal: harness wall / raw >= 0.98.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from harness.dist import free_port  # noqa: E402

BIN = Path(sys.executable).parent
GOAL = 0.98


def env() -> dict:
    out = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    # One ninja for every launch: the venv's (1.13) and the system's (1.11) hash build commands differently,
    # so mixing them makes each launch recompile DeepSpeed's JIT ops.
    out["PATH"] = f"{BIN}{os.pathsep}{out.get('PATH', '')}"
    return out


def deepspeed(ranks: int, script: str, *args: str) -> subprocess.CompletedProcess:
    """Both scripts unlink DeepSpeed's /dev/shm all-reduce buffers themselves (harness.dist.unlink_shm_buffer)."""
    cmd = [str(BIN / "deepspeed"), "--master_port", str(free_port()), "--num_gpus", str(ranks), script, *args]
    return subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=1800)


def fail(proc: subprocess.CompletedProcess) -> SystemExit:
    return SystemExit(f"{' '.join(proc.args)} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")


def run_harness(args, run_dir: Path, profiling: bool) -> dict:
    extra = [] if profiling else ["--profile-steps", ""]
    proc = deepspeed(args.ranks, "harness/run.py", "--recipe", args.recipe, "--set", f"train.steps={args.steps}",
                     "--output-dir", str(run_dir), *extra)
    if not (run_dir / "summary.json").is_file():
        raise fail(proc)
    train = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
             if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, args.steps + 1)), "harness logged unexpected steps"
    tokens_per_step = train[0]["tokens_per_s"] * train[0]["step_time_s"]
    timed = train[args.warmup_steps:]
    wall_s = train[-1]["time"] - train[args.warmup_steps - 1]["time"]  # stamps are rounded to 1 ms
    self_s = sum(r["step_time_s"] for r in timed)
    deltas = {b["step"]: b["time"] - a["time"] for a, b in zip(train, train[1:])}
    profiled = [r["step"] for r in train if r.get("profiled")]
    steady = statistics.median(deltas[r["step"]] for r in timed)
    window_ms = [1000 * (deltas[s] - steady) for s in profiled if s in deltas]
    # finished (summary written) but exited non-zero: a teardown failure, reported, not hidden
    note = f"harness exited {proc.returncode} after writing summary.json" if proc.returncode else ""
    if note:
        print(f"  WARNING: {note}; last lines:\n{proc.stderr[-800:]}", flush=True)
    return {"tokens_per_s": tokens_per_step * len(timed) / wall_s, "tokens_per_step": tokens_per_step,
            "step_s": [deltas[r["step"]] for r in timed],
            "self": tokens_per_step * len(timed) / self_s,
            "overhead_ms": 1000 * (wall_s - self_s) / len(timed), "loss": [r["loss"] for r in train],
            "profiled_steps": profiled, "window_extra_ms": window_ms, "note": note}


def run_raw(args, run_dir: Path) -> dict:
    proc = deepspeed(args.ranks, "bench/raw_deepspeed.py", "--run-dir", str(run_dir), "--steps", str(args.steps),
                     "--warmup-steps", str(args.warmup_steps))
    lines = [line for line in proc.stdout.splitlines() if line.startswith('{"raw"')]
    if proc.returncode != 0 or not lines:
        raise fail(proc)
    return json.loads(lines[0])


def quantile(values: list[float], q: float) -> float:
    """Low quantiles of step time are what a step costs when the shared machine leaves it alone."""
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def check_same_work(harness: dict, raw: dict) -> float:
    worst = max(abs(h - r) / abs(r) for h, r in zip(harness["loss"], raw["loss"]))
    if worst > 1e-5:
        raise SystemExit(f"harness and raw losses differ (max relative {worst:.2e}): they did not train the same "
                         f"thing\n  harness {harness['loss'][:5]}\n  raw     {raw['loss'][:5]}")
    return worst


def run_variant(args, name: str, profiling: bool, workdir: Path) -> list[dict]:
    arms = ["harness", "raw"]
    rows, config_dir = [], None
    for pair in range(args.pairs):
        order = arms[pair % len(arms):] + arms[:pair % len(arms)]  # rotate; pair 1 starts with the harness
        got = {}
        for arm in order:
            if arm == "harness":
                run_dir = workdir / f"{name}_{pair}"
                got[arm] = run_harness(args, run_dir, profiling)
                config_dir = config_dir or run_dir
            else:
                got[arm] = run_raw(args, config_dir)
        h, r = got["harness"], got["raw"]
        raw_steps = r["step_time_s"][args.warmup_steps:]
        row = {"variant": name, "pair": pair + 1, "order": "-".join(order),
               "harness": h["tokens_per_s"], "harness_self": h["self"], "raw": r["tokens_per_s"],
               "ratio": h["tokens_per_s"] / r["tokens_per_s"], "ratio_self": h["self"] / r["tokens_per_s"],
               "ratio_median": statistics.median(raw_steps) / statistics.median(h["step_s"]),
               "ratio_p20": quantile(raw_steps, 0.2) / quantile(h["step_s"], 0.2),
               "harness_step_s": h["step_s"], "raw_step_s": raw_steps,
               "overhead_ms": h["overhead_ms"], "loss_rel_diff": check_same_work(h, r),
               "profiled": h["profiled_steps"], "window_extra_ms": h["window_extra_ms"], "note": h["note"]}
        rows.append(row)
        print(f"  {name} pair {row['pair']} ({row['order']}): harness {row['harness']:.0f} tok/s (self "
              f"{row['harness_self']:.0f}), raw {row['raw']:.0f} tok/s, ratio {row['ratio']:.3f} (median step "
              f"{row['ratio_median']:.3f}, p20 step {row['ratio_p20']:.3f})", flush=True)
    return rows


def table(rows: list[dict], args) -> str:
    head = ("| variant | pair | order | harness tok/s | harness tok/s (own step_time_s) | raw tok/s | ratio | "
            "ratio median step | ratio p20 step | ratio (own) | ms/step outside the loop |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['pair']} | {r['order']} | {r['harness']:.0f} | {r['harness_self']:.0f} | "
                     f"{r['raw']:.0f} | {r['ratio']:.3f} | {r['ratio_median']:.3f} | {r['ratio_p20']:.3f} | "
                     f"{r['ratio_self']:.3f} | {r['overhead_ms']:.1f} |")
    lines.append(f"\nrecipe {args.recipe}, {args.ranks} ranks, {args.steps} steps; timed: steps "
                 f"{args.warmup_steps + 1}-{args.steps} on both sides; ratio = harness / raw, goal >= {GOAL}")
    for variant in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == variant]
        ratio = statistics.median(r["ratio"] for r in mine)
        line = (f"profiling {variant}: median ratio {ratio:.3f} ({'meets' if ratio >= GOAL else 'misses'} the goal); "
                f"per-step median / p20 ratios {statistics.median(r['ratio_median'] for r in mine):.3f} / "
                f"{statistics.median(r['ratio_p20'] for r in mine):.3f}; "
                f"by the harness's own step_time_s {statistics.median(r['ratio_self'] for r in mine):.3f}; "
                f"outside the micro-batch loop {statistics.median(r['overhead_ms'] for r in mine):.1f} ms/step")
        window = [ms for r in mine for ms in r["window_extra_ms"]]
        if window:
            line += (f"; profiled steps {mine[0]['profiled']} (not timed) took {statistics.median(window):.0f} ms "
                     "more than a steady step")
        lines.append(line)
        lines += [f"  note: pair {r['pair']}: {r['note']}" for r in mine if r["note"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warmup-steps", type=int, default=5, help="steps left out of the timing, both sides")
    p.add_argument("--recipe", default="zero2")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--variants", default="off,on", help="off: --profile-steps ''; on: the recipe's window")
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = p.parse_args(argv)
    if not 1 <= args.warmup_steps < args.steps:
        p.error(f"--warmup-steps ({args.warmup_steps}) must be in [1, --steps={args.steps})")
    rows = []
    with tempfile.TemporaryDirectory(prefix="overhead_") as tmp:
        for variant in args.variants.split(","):
            rows += run_variant(args, variant, variant == "on", Path(tmp))
    print(table(rows, args))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
