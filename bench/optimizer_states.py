"""Fewer bytes per parameter side by side (docs/optimizers.md): AdamW with fp32 states, bf16 master + states, Muon,
Muon with bf16 states, each ZeRO-2 on the same ranks, model and data.

    python bench/optimizer_states.py [--ranks 2] [--steps 300] [--hidden 512] [--layers 8] [--keep DIR]

Writes a Llama-shaped model folder (seeded random weights, the shipped 512-id tokenizer; hidden/layers set its
size), then trains it --steps steps per combination on the built-in corpus (harness/run.py, bf16, seq 128, micro 4,
lr 3e-4 with warmup; Muon's matrices at muon_lr 0.02). Reported per combination, from each run's own files: the
loss at the first and last step and its gap to the fp32-state run's, the mean step time (summary.json
throughput), and per rank the measured model states after the last step beside the planner's (summary.json
memory: the profiling hook's live count against predicted_after_step_per_rank) and the peak in-use memory beside
the planner's predicted peak. Everything written goes under a temporary folder, deleted at the end (unless --keep).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from harness.dist import free_port  # noqa: E402

COMBINATIONS = {  # name: (recipe, extra --set overrides)
    "adamw fp32 states": ("zero2", []),
    "adamw bf16 master+states": ("zero2_bf16_states", []),
    "muon": ("zero2_muon", []),
    "muon bf16 master+states": ("zero2_muon", ["optimizer.master_dtype=bf16", "optimizer.state_dtype=bf16"]),
}


def write_model(folder: Path, hidden: int, layers: int) -> int:
    """The shipped 512-id tokenizer's vocabulary, MLP 11/4 x hidden, heads of 64."""
    from lora_footprint import write_model as write_llama

    return write_llama(folder, vocab=512, hidden=hidden, mlp=hidden * 11 // 4, layers=layers,
                       heads=max(1, hidden // 64))


def train(run: Path, model: Path, ranks: int, steps: int, recipe: str, sets: list[str]) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=str(ROOT))
    overrides = [f"train.model={model}", f"train.steps={steps}", "train.seq_len=128", "batch.micro_batch_per_gpu=4",
                 "train.eval_every=0", "train.eval_fraction=0.01", f"train.save_every={steps + 1}", *sets]
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--master_port", str(free_port()), "--num_gpus", str(ranks),
           "harness/run.py", "--recipe", recipe, "--output-dir", str(run), "--profile-steps", f"{steps}-{steps}"]
    for item in overrides:
        cmd += ["--set", item]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    summary = json.loads((run / "summary.json").read_text())
    mem = summary["memory"]
    states = [sum(sum(t.values()) for t in r.values()) for r in mem["model_states_per_rank"]]
    planned = [sum(sum(t.values()) for t in r.values()) for r in mem["predicted_after_step_per_rank"]]
    peaks = [r.get("peak_in_use_bytes", 0) for r in mem["peak_per_rank"]]
    losses = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in losses if r["kind"] == "train"}
    step_s = (summary["throughput"].get("step_time") or {}).get("measured_median_s_per_rank") or [None]
    return {"first": losses[1], "last": losses[steps], "step_s": max(step_s, key=lambda s: s or 0),
            "states": max(states), "planned_states": max(planned), "peak": max(peaks),
            "planned_peak": max(mem.get("predicted_peak_total_per_rank") or [0])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--keep", help="keep the model and runs in this folder")
    args = parser.parse_args()
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="optimizer_states_"))
    results = {}
    try:
        params = write_model(work / "model", args.hidden, args.layers)
        for name, (recipe, sets) in COMBINATIONS.items():
            results[name] = train(work / name.replace(" ", "_").replace("+", "_"), work / "model", args.ranks,
                                  args.steps, recipe, sets)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    base = results["adamw fp32 states"]
    print(f"model {params / 1e6:.1f}M params, ZeRO-2 on {args.ranks} CPU ranks, bf16, {args.steps} steps")
    print(f"{'combination':<26}{'loss 1':>8}{'loss N':>8}{'vs fp32':>9}{'step s':>8}"
          f"{'states/rank':>13}{'planned':>11}{'peak/rank':>12}{'planned':>11}")
    for name, r in results.items():
        gap = (r["last"] - base["last"]) / base["last"]
        step = f"{r['step_s']:.3f}" if r["step_s"] else "-"
        print(f"{name:<26}{r['first']:>8.3f}{r['last']:>8.3f}{gap:>+9.2%}{step:>8}{r['states'] / 1e6:>11.2f}MB"
              f"{r['planned_states'] / 1e6:>9.2f}MB{r['peak'] / 1e6:>10.1f}MB{r['planned_peak'] / 1e6:>9.1f}MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
