"""What the per-step numeric-fault check costs: the same run with train.on_nonfinite=stop (the default: per step a
pass over this rank's reduced gradients for inf/NaN, one all-reduce of 2 x world + 2 numbers and one host sync,
harness/train/faults.py) and with train.on_nonfinite=off (no per-step check), alternating the order each repeat
because the machine is shared; profiling off in both.

    python bench/numeric_faults.py [--recipe zero2] [--steps 60] [--seq-len 128] [--repeats 2] [--json out.json]

Prints the median step time (the trainer's step_time_s, which includes the check) and the wall-clock tokens/s of
each run, the difference (on - off), and the check's own time per step as the run measured it (summary.json
nonfinite_check_ms: flag, all-reduce and host read; on CUDA it includes waiting for the step's queued kernels).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from profile_overhead import launch, measure  # bench/profile_overhead.py: one launch, one measurement

QUIET = ["--profile-steps", "", "--set", "profile.memory=false"]
MODES = {"on": ["--set", "train.on_nonfinite=stop", *QUIET], "off": ["--set", "train.on_nonfinite=off", *QUIET]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="zero2")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", help="write the measurements here")
    args = p.parse_args(argv)
    results: dict[str, list[dict]] = {"on": [], "off": []}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for mode in (("on", "off") if repeat % 2 == 0 else ("off", "on")):
                run_dir = Path(tmp) / f"{mode}{repeat}"
                launch(args.recipe, args.steps, args.seq_len, args.ranks, MODES[mode], run_dir)
                m = measure(run_dir)
                summary = json.loads((run_dir / "summary.json").read_text())
                m["check_ms"], m["local_ms"] = summary.get("nonfinite_check_ms"), summary.get("nonfinite_check_local_ms")
                results[mode].append(m)
                print(f"[bench]   repeat {repeat} check {mode:<3}: median step {m['step_ms_median']:.2f} ms, "
                      f"{m['tokens_per_s']:.0f} tokens/s" + (f"; the check {m['check_ms']:.3f} ms per step, of which "
                                                             f"the local flags {m['local_ms']:.3f} ms"
                                                             if m["check_ms"] is not None else ""), flush=True)

    def med(mode: str, key: str) -> float:
        return statistics.median(m[key] for m in results[mode])

    on, off, own, local = (med("on", "step_ms_median"), med("off", "step_ms_median"), med("on", "check_ms"),
                           med("on", "local_ms"))
    print(f"[bench]   {args.recipe}, {args.ranks} ranks, seq {args.seq_len}: median step {on:.2f} ms with the check, "
          f"{off:.2f} ms without: {on - off:+.2f} ms per step ({100 * (on - off) / off:+.1f} %); tokens/s "
          f"{med('on', 'tokens_per_s'):.0f} vs {med('off', 'tokens_per_s'):.0f}; timed inside the run, the check "
          f"itself takes {own:.3f} ms per step ({100 * own / on:.2f} % of the step), the local flags {local:.3f} ms, "
          "the rest is the all-reduce (with whatever the ranks lag each other by) and the host read")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
