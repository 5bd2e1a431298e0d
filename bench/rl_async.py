"""rl.async against the synchronous GRPO step on the same CPU job, side by side in one run: the built-in toy task on
the built-in tiny Llama, one process (python harness/run.py), ZeRO-2, fp32, 16 completions per step of up to
--completion tokens, AdamW lr 3e-2; the async side with rl.max_staleness --staleness (weight_sync_steps 1).

    python bench/rl_async.py [--steps 12] [--pairs 2] [--completion 48] [--staleness 1]   (~1 min a pair, 2 idle cores)

Pairs run back to back in alternating order (S A, A S, ...), so drift on a shared machine hits both sides. Per side,
the median over steps 2.. (the first pays the generator process's start and the first sync) of: step_time_s, the
trainer's wait for rollouts (time/generate_s: the whole generation when synchronous, what was left of it when async),
the generator's own seconds (time/generator_s, async), train_s and sync_s. The gain: sync median step / async median
step (the overlap's: max(generate, train) + sync against generate + train + sync, as harness plan --async prices it).
The generator process needs a core of its own besides the trainer's: on a machine whose cores are busy the overlap
shrinks toward nothing.
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
PARTS = ("step_time_s", "time/generate_s", "time/generator_s", "time/train_s", "time/sync_s")


def env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))


def run(out: Path, args, asynchronous: bool) -> dict:
    sets = {"train.model": "tiny-llama", "train.objective": "grpo", "precision": "fp32", "train.steps": args.steps,
            "batch.micro_batch_per_gpu": 16, "batch.grad_accum_steps": 1, "batch.train_batch_size": '"auto"',
            "optimizer.type": "adamw", "optimizer.lr": 3e-2, "optimizer.weight_decay": 0, "scheduler.type": "none",
            "rl.num_generations": 4, "rl.max_completion_length": args.completion, "train.log_every": 1,
            "train.save_every": 0, "rl.async": str(asynchronous).lower(), "rl.max_staleness": args.staleness}
    cmd = [sys.executable, "harness/run.py", "--recipe", "zero2", "--output-dir", str(out), "--profile-steps", ""]
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stderr[-3000:]}")
    steps = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]
    later = steps[1:]
    return {part: statistics.median(r.get(part) or 0.0 for r in later) for part in PARTS} | \
        {"reward_last": statistics.mean(r["reward"] for r in steps[-3:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--completion", type=int, default=48)
    parser.add_argument("--staleness", type=int, default=1)
    args = parser.parse_args()
    sides = {"sync": [], "async": []}
    with tempfile.TemporaryDirectory(prefix="rl_async_bench_") as tmp:
        for pair in range(args.pairs):
            order = ("sync", "async") if pair % 2 == 0 else ("async", "sync")
            for side in order:
                sides[side].append(run(Path(tmp) / f"{side}{pair}", args, side == "async"))
    print(f"{args.steps} steps x {args.pairs} pairs, 16 completions of <= {args.completion} tokens, max_staleness "
          f"{args.staleness}; medians over steps 2.. per run, then over the runs (s)")
    print(f"{'side':6} " + " ".join(f"{p:>18}" for p in PARTS) + f" {'reward (last 3)':>16}")
    summary = {}
    for side, runs in sides.items():
        summary[side] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(f"{side:6} " + " ".join(f"{summary[side][p]:18.4f}" for p in PARTS)
              + f" {summary[side]['reward_last']:16.3f}")
    gains = [s["step_time_s"] / a["step_time_s"] for s, a in zip(sides["sync"], sides["async"])]
    print(f"gain (sync / async median step): {statistics.median(gains):.2f} (per pair: "
          + ", ".join(f"{g:.2f}" for g in gains) + f"); load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
