"""What profiling costs: tokens/s with the default profiling (window + memory hook) over tokens/s without.

Launches the same recipe with profiling on (the recipe's default window, profile.memory on) and off
(`--profile-steps ''`, profile.memory=false), alternating the order each repeat because the machine is
shared. Throughput is wall clock between logged records (so the hooks' own work after each step, the
gathers on profiled steps and the blocking collectives in the window all count), over all steps after
the first two:

    tokens/s = tokens per step x (N - 2) / (time of record N - time of record 2)

    python bench/profile_overhead.py [--recipe zero2] [--steps 200] [--repeats 3] [--json out.json]

Goal: on / off >= 0.95 with the default window.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from overhead import deepspeed, fail  # bench/overhead.py: one launch helper (env, port, venv PATH)

GOAL = 0.95
SKIP = 2  # warm-up steps left out
MODES = {"on": [], "off": ["--profile-steps", "", "--set", "profile.memory=false"]}


def launch(recipe: str, steps: int, seq_len: int, ranks: int, extra: list[str], out: Path) -> None:
    proc = deepspeed(ranks, "harness/run.py", "--recipe", recipe, "--set", f"train.steps={steps}",
                     "--set", f"train.seq_len={seq_len}", "--set", "train.eval_every=0", "--output-dir", str(out),
                     "--overwrite", *extra)
    if proc.returncode != 0:
        raise fail(proc)


def measure(run_dir: Path) -> dict:
    """tokens/s over wall clock, and the time per step spent outside the trainer's step (hooks, logging)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    train = [r for r in map(json.loads, lines) if r["kind"] == "train"]
    tokens_per_step = train[0]["tokens_per_s"] * train[0]["step_time_s"]
    first, last = train[SKIP - 1], train[-1]
    outside = [1000 * (b["time"] - a["time"] - b["step_time_s"]) for a, b in zip(train[SKIP - 1:], train[SKIP:])]
    profiled = [o for o, r in zip(outside, train[SKIP:]) if r.get("profiled")]
    return {"tokens_per_s": tokens_per_step * (last["step"] - first["step"]) / (last["time"] - first["time"]),
            "step_ms_median": 1000 * statistics.median(r["step_time_s"] for r in train[SKIP:]),
            "outside_step_ms_median": statistics.median(outside),
            "outside_step_ms_profiled": statistics.mean(profiled) if profiled else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="zero2")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", help="write the measurements here")
    args = p.parse_args(argv)
    results: dict[str, list[dict]] = {"on": [], "off": []}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            order = ("on", "off") if repeat % 2 == 0 else ("off", "on")
            for mode in order:
                run_dir = Path(tmp) / f"{mode}{repeat}"
                launch(args.recipe, args.steps, args.seq_len, args.ranks, MODES[mode], run_dir)
                m = measure(run_dir)
                results[mode].append(m)
                profiled = m["outside_step_ms_profiled"]
                print(f"[bench]   repeat {repeat} profiling {mode:<3}: {m['tokens_per_s']:8.0f} tokens/s; median "
                      f"step {m['step_ms_median']:.1f} ms + {m['outside_step_ms_median']:.2f} ms outside it"
                      + (f", {profiled:.1f} ms on profiled steps" if profiled is not None else ""), flush=True)
    def med(mode, key):
        return statistics.median(m[key] for m in results[mode])

    pairs = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(results["on"], results["off"])]
    ratio = statistics.median(pairs)
    hooks_ms = med("on", "outside_step_ms_median") - med("off", "outside_step_ms_median")
    verdict = "meets" if ratio >= GOAL else "misses"
    print(f"[bench]   {args.recipe}, {args.ranks} ranks, {args.steps} steps x seq {args.seq_len}: tokens/s with "
          f"profiling / without = {ratio:.3f} (median of repeats {', '.join(f'{p:.3f}' for p in pairs)}; "
          f"{verdict} the goal >= {GOAL})")
    print(f"[bench]   the hooks add {hooks_ms:.2f} ms to a {med('off', 'step_ms_median'):.1f} ms step "
          f"(median time outside the step, on - off); a spread of ratios wider than that is the machine's noise")
    if args.json:
        Path(args.json).write_text(json.dumps({"recipe": args.recipe, "steps": args.steps, "seq_len": args.seq_len,
                                               "runs": results, "ratio": ratio, "ratio_per_repeat": pairs,
                                               "goal": GOAL}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
