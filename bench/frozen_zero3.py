"""LoRA on ZeRO-3 with activation checkpointing: do frozen base weights stay gathered after recompute?

    python bench/frozen_zero3.py [--size 0.2] [--precision bf16] [--steps 2] [--out /tmp/frozen_zero3]

DeepSpeed >= 0.19.3 was reported (deepspeedai/DeepSpeed#8148, a downstream project pinning 0.19.2) to leave frozen
ZeRO-3 parameters gathered after the non-reentrant checkpoint's recompute: the `lora_zero3` path. On a Llama-shaped
folder of bench/scale.py (0.2: 0.21B parameters, written once with random weights), 2 CPU ranks, this runs:
  1. lora_zero3 with activation_checkpointing on, then off, through harness/run.py: each rank's training peak in use
     and RssAnon (summary.json memory.peak_per_rank) beside the planner's prediction for the run (the same figures
     as bench/scale.py, above each rank's own baseline);
  2. tests/drivers/frozen_zero3.py on the same folder with checkpointing on: after each step, the frozen ZeRO-3
     parameters (not persistent) still gathered on each rank, and their bytes. A leak shows there as whole layers.
The test (tests/test_frozen_zero3.py) runs step 2 on the tiny model. Not a test itself: minutes on two cores.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import scale  # noqa: E402
from harness.dist import free_port  # noqa: E402

scale.RANKS.setdefault("lora_zero3", 2)


def train(folder: Path, out: Path, precision: str, steps: int, checkpointing: bool) -> dict:
    run = out / f"run-ckpt-{'on' if checkpointing else 'off'}"
    cmd = scale._train_cmd("lora_zero3", precision, folder, run, steps)
    cmd += ["--set", f"activation_checkpointing={str(checkpointing).lower()}", "--set", "train.save_every=0"]
    watch = scale._watch(cmd, scale._env(), out / f"{run.name}.log", run / "metrics.jsonl", last_step=steps)
    if watch["rc"]:
        return {"checkpointing": checkpointing, "error": (out / f"{run.name}.log").read_text()[-1500:]}
    summary = json.loads((run / "summary.json").read_text())
    memory, startup = summary["memory"], summary["startup"]
    baselines = [r["build"]["rss_anon_before_bytes"] for r in startup["per_rank"]]
    predicted = memory.get("predicted_peak_total_per_rank") or [None] * len(baselines)
    shutil.rmtree(run, ignore_errors=True)
    return {"checkpointing": checkpointing, "seconds": round(watch["seconds"], 1),
            "in_use": [p.get("peak_in_use_bytes") for p in memory["peak_per_rank"]],
            "rss_anon": [p.get("peak_rss_anon_bytes") for p in memory["peak_per_rank"]],
            "predicted": [None if p is None else b + p for b, p in zip(baselines, predicted)]}


def frozen(folder: Path, out: Path, precision: str) -> dict:
    report = out / "frozen.json"
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--master_port", str(free_port()), "--num_gpus", "2",
           "tests/drivers/frozen_zero3.py", str(report), "--recipe", "lora_zero3", "--model", str(folder),
           "--output-dir", str(out / "run-frozen"), "--overwrite", "--set", f"precision={precision}",
           "--set", "train.seq_len=128", "--set", "batch.micro_batch_per_gpu=1",
           "--set", "activation_checkpointing=true"]
    watch = scale._watch(cmd, scale._env(), out / "frozen.log")
    shutil.rmtree(out / "run-frozen", ignore_errors=True)
    return json.loads(report.read_text()) if watch["rc"] == 0 else {"error": (out / "frozen.log").read_text()[-1500:]}


def mib(x) -> str:
    return "n/a" if x is None else f"{x / scale.MIB:,.0f} MiB"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="0.2", choices=sorted(scale.SIZES))
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", default="/tmp/frozen_zero3")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    folder = out / f"llama-{args.size}"
    params = scale.write_folder(args.size, folder) if not (folder / "config.json").exists() else None
    runs = [train(folder, out, args.precision, args.steps, on) for on in (True, False)]
    leak = frozen(folder, out, args.precision)
    (out / "results.json").write_text(json.dumps({"size": args.size, "params": params, "runs": runs, "frozen": leak},
                                                 indent=2))
    print(f"lora_zero3, {args.size}B Llama folder ({params or 'existing'} params), {args.precision}, 2 CPU ranks")
    for run in runs:
        if "error" in run:
            print(f"  checkpointing {run['checkpointing']}: FAILED {run['error'][-300:]!r}")
            continue
        for rank, (use, anon, pred) in enumerate(zip(run["in_use"], run["rss_anon"], run["predicted"])):
            ratio = f"{use / pred:.2f}" if use and pred else "n/a"
            print(f"  checkpointing {'on ' if run['checkpointing'] else 'off'} rank {rank}: train in use {mib(use)}"
                  f" (RssAnon {mib(anon)}) vs planner {mib(pred)}: x{ratio}")
    if "error" in leak:
        print(f"  frozen check FAILED: {leak['error'][-300:]!r}")
    else:
        for rank, states in enumerate(leak["ranks"]):
            for step, s in enumerate(states, 1):
                print(f"  rank {rank} after step {step}: {len(s['gathered'])} of {s['frozen'] - s['persistent']} "
                      f"partitioned frozen parameters still gathered ({mib(s['gathered_bytes'])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
