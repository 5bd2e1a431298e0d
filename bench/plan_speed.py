"""How fast `harness plan` answers (target: under 3 s for a 70B config end to end, 1024 nodes included; #16 asks 5 s).

Times the whole command in a fresh interpreter (what a person waits for, imports included), then the
planner alone in-process, then the exact meta-device parameter count that the closed form avoids.

    python bench/plan_speed.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

COMMANDS = [
    ["plan", "--model", "llama-2-70b", "--gpus", "8", "--nodes", "2", "--gpu-mem", "80GB"],
    ["plan", "--model", "llama-3.1-405b", "--gpus", "8", "--gpu-mem", "80GB", "--cpu-mem", "1TB", "--json"],
    ["plan", "--model", "llama-2-7b", "--gpus", "8", "--gpu-mem", "80GB"],
    ["plan", "--model", "llama-2-70b", "--gpus", "8", "--nodes", "1024", "--gpu-mem", "80GB"],  # the search at scale
]
TARGET_S = 3.0


def time_cli(argv: list[str], repeat: int) -> list[float]:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "harness.cli", *argv], capture_output=True, text=True)
        times.append(time.perf_counter() - start)
        if proc.returncode not in (0, 1):
            raise SystemExit(f"harness {' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return times


def time_in_process(repeat: int) -> dict[str, float]:
    from harness.model_shapes import KNOWN
    from harness.planner import plan
    from harness.planner.inputs import Cluster, Workload
    from harness.planner.params import meta_count

    out = {}
    for name in ("llama-2-7b", "llama-2-70b", "llama-3.1-405b"):
        start = time.perf_counter()
        for _ in range(repeat):
            plan(KNOWN[name], Cluster(8, 80 * 10**9, nodes=2), Workload(), model_name=name)
        out[f"plan() {name}"] = (time.perf_counter() - start) / repeat
    start = time.perf_counter()
    meta_count(KNOWN["llama-2-70b"])
    out["meta-device count llama-2-70b (first call, imports torch + transformers)"] = time.perf_counter() - start
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    worst = 0.0
    print(f"end to end (fresh interpreter, {args.repeat} runs): median / max seconds")
    for argv in COMMANDS:
        times = time_cli(argv, args.repeat)
        worst = max(worst, max(times))
        print(f"  {statistics.median(times):6.3f} / {max(times):6.3f}  harness {' '.join(argv)}")
    print("in process:")
    for label, seconds in time_in_process(args.repeat).items():
        print(f"  {seconds:8.4f} s  {label}")
    verdict = "ok" if worst < TARGET_S else "TOO SLOW"
    print(f"slowest end-to-end run {worst:.2f} s vs target {TARGET_S:.0f} s: {verdict}")
    return 0 if worst < TARGET_S else 1


if __name__ == "__main__":
    sys.exit(main())
