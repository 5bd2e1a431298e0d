"""Fewer bytes per parameter side by side (docs/optimizers.md): AdamW with fp32 states, bf16 master + states, bf16
master + states with stochastic rounding (torchao), bf16 master with fp32 states (CPU offload, beside fp32 states
with the same offload), Muon, Muon with bf16 states, each ZeRO-2 on the same ranks, model and data.

    python bench/optimizer_states.py [--ranks 2] [--steps 300] [--muon-steps N] [--hidden 512] [--layers 8]
                                     [--vocab 512] [--only fp32,bf16,...] [--set KEY=VALUE ...] [--keep DIR]

Writes a Llama-shaped model folder (seeded random weights, the shipped 512-id tokenizer's ids; hidden/layers/vocab
set its size), then trains it --steps steps per combination on the built-in corpus (harness/run.py, bf16, seq
--seq-len, micro --micro, lr 3e-4 with warmup and linear decay; Muon's matrices at muon_lr 0.02); --set adds
recipe overrides to every combination (scheduler.type=WarmupLR: a constant lr after warmup); --muon-steps runs
the Muon rows shorter (their Newton-Schulz step is minutes on a large model on CPU). Reported per combination, from
each run's own files: the loss at the first step, at the step all rows reached and at its last, the gap at the
common step to the first combination's, the median step time (summary.json throughput), and per rank (the larger
of the ranks) the model states after the last step beside the planner's (the profiling hook's live count against
predicted_after_step_per_rank), the training peak in use (RssAnon less malloc's free bytes, sampled every 20 ms
in the rank: summary.json memory.peak_per_rank) beside the rank's RssAnon before the build plus the planner's
training peak, and the RssAnon and VmHWM peaks of the steps. Everything written goes under a temporary folder,
deleted at the end (unless --keep).
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

BF16 = ["optimizer.master_dtype=bf16", "optimizer.state_dtype=bf16"]
OFFLOAD = ["zero.offload_optimizer=cpu"]
COMBINATIONS = {  # key: (name, recipe, extra --set overrides)
    "fp32": ("adamw fp32 states", "zero2", []),
    "bf16": ("adamw bf16 master+states", "zero2_bf16_states", []),
    "bf16-sr": ("adamw bf16, stochastic round", "zero2_bf16_sr", []),
    "fp32-offload": ("adamw fp32 states, offload", "zero2", OFFLOAD),
    "bf16-master-offload": ("adamw bf16 master, offload", "zero2", OFFLOAD + ["optimizer.master_dtype=bf16"]),
    "muon": ("muon", "zero2_muon", []),
    "muon-bf16": ("muon bf16 master+states", "zero2_muon", BF16),
}
MB = 1e6


def write_model(folder: Path, hidden: int, layers: int, vocab: int) -> int:
    """MLP 11/4 x hidden, heads of 64."""
    from lora_footprint import write_model as write_llama

    return write_llama(folder, vocab=vocab, hidden=hidden, mlp=hidden * 11 // 4, layers=layers,
                       heads=max(1, hidden // 64))


def train(run: Path, model: Path, args, recipe: str, sets: list[str], steps: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=str(ROOT))
    overrides = [f"train.model={model}", f"train.steps={steps}", f"train.seq_len={args.seq_len}",
                 f"batch.micro_batch_per_gpu={args.micro}", "train.eval_every=0", "train.eval_fraction=0.01",
                 f"train.save_every={steps + 1}", *sets, *args.set]
    for attempt in range(3):  # the port free_port found may be taken by another job before the ranks bind it
        cmd = [str(Path(sys.executable).parent / "deepspeed"), "--master_port", str(free_port()), "--num_gpus",
               str(args.ranks), "harness/run.py", "--recipe", recipe, "--output-dir", str(run), "--profile-steps",
               f"{steps}-{steps}"]
        for item in overrides:
            cmd += ["--set", item]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if "EADDRINUSE" not in proc.stderr:
            break
        shutil.rmtree(run, ignore_errors=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return read_run(run, steps)


def read_run(run: Path, steps: int) -> dict:
    summary = json.loads((run / "summary.json").read_text())
    mem = summary["memory"]
    states = [sum(sum(t.values()) for t in r.values()) for r in mem["model_states_per_rank"]]
    planned = [sum(sum(t.values()) for t in r.values()) for r in mem["predicted_after_step_per_rank"]]
    peaks = mem["peak_per_rank"]
    before = [r["build"]["rss_anon_before_bytes"] or 0 for r in summary["startup"]["per_rank"]]
    peak_plan = mem.get("predicted_peak_total_per_rank") or [0] * len(peaks)
    losses = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in losses if r["kind"] == "train"}
    step_s = (summary["throughput"].get("step_time") or {}).get("measured_median_s_per_rank") or [None]
    worst = max(range(len(peaks)), key=lambda r: peaks[r].get("peak_in_use_bytes") or 0)
    return {"losses": losses, "first": losses[1], "last": losses[steps], "steps": steps,
            "step_s": max(step_s, key=lambda s: s or 0),
            "states": max(states), "planned_states": max(planned),
            "in_use": peaks[worst].get("peak_in_use_bytes") or 0,
            "planned_peak": before[worst] + (peak_plan[worst] or 0), "baseline": before[worst],
            "rss_anon": max(p.get("peak_rss_anon_bytes") or 0 for p in peaks),
            "vm_hwm": max(p.get("peak_rss_bytes") or 0 for p in peaks)}


def render(results: dict, base: str) -> list[str]:
    common = min(r["steps"] for r in results.values())
    lines = [f"{'combination':<30}{'steps':>6}{'loss 1':>7}{f'loss {common}':>8}{'loss N':>7}{'vs ' + base[:9]:>13}"
             f"{'step s':>8}{'states MB':>10}{'planned':>9}{'in use MB':>10}{'planned':>9}{'RssAnon':>9}{'VmHWM':>8}"]
    first = results[base]["losses"][common]
    for name, r in results.items():
        at = r["losses"][common]
        gap = (at - first) / first
        step = f"{r['step_s']:.3f}" if r["step_s"] else "-"
        lines.append(f"{name:<30}{r['steps']:>6}{r['first']:>7.3f}{at:>8.3f}{r['last']:>7.3f}{gap:>+13.2%}{step:>8}"
                     f"{r['states'] / MB:>10.2f}"
                     f"{r['planned_states'] / MB:>9.2f}{r['in_use'] / MB:>10.0f}{r['planned_peak'] / MB:>9.0f}"
                     f"{r['rss_anon'] / MB:>9.0f}{r['vm_hwm'] / MB:>8.0f}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--muon-steps", type=int, help="steps of the Muon rows (default --steps)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--only", default=",".join(COMBINATIONS), help=f"of {', '.join(COMBINATIONS)}")
    parser.add_argument("--set", action="append", default=[], help="a recipe override for every combination")
    parser.add_argument("--keep", help="keep the model and runs in this folder")
    args = parser.parse_args()
    keys = args.only.split(",")
    if unknown := [k for k in keys if k not in COMBINATIONS]:
        parser.error(f"--only {','.join(unknown)}: expected some of {', '.join(COMBINATIONS)}")
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="optimizer_states_"))
    results = {}
    try:
        params = write_model(work / "model", args.hidden, args.layers, args.vocab)
        for key in keys:
            name, recipe, sets = COMBINATIONS[key]
            steps = args.muon_steps if key.startswith("muon") and args.muon_steps else args.steps
            results[name] = train(work / key, work / "model", args, recipe, sets, steps)
            print(f"{name}: {json.dumps(results[name])}", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    sets = f", {' '.join(args.set)}" if args.set else ""
    print(f"model {params / 1e6:.1f}M params, ZeRO-2 on {args.ranks} CPU ranks, bf16, seq {args.seq_len}, "
          f"micro {args.micro}, {args.steps} steps (Muon rows {args.muon_steps or args.steps}){sets}")
    print("\n".join(render(results, next(iter(results)))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
