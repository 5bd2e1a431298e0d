"""MoE on 2 CPU ranks: expert parallelism (DeepSpeed AutoEP) against ZeRO-3 with leaves, measured and predicted, and
the harness against a raw DeepSpeed AutoEP loop on the same config (issue #26).

    python bench/moe.py [--steps 12] [--warmup-steps 3] [--hardware FILE] [--pairs 2]

Model: a random-weight Mixtral of ~7.4M parameters (8 routed experts, top 2, 4 sparse blocks, hidden 256, the
built-in tokenizer) saved into --work. Unless --hardware is given, `harness calibrate` measures this machine at the
model's shapes first. Layouts, same global batch (8 x 128 tokens):
  ep2     --recipe zero2 --set parallel.expert=2  (AutoEP, 4 experts per rank)
  zero3   --recipe zero3                          (the harness's leaf table: one sparse block gathered at once)
Each run records its own prediction (summary.json throughput.step_time: the planner's step time for this very
layout on the profile, planner/steptime.py with planner/moe.py's all-to-all and imbalance terms) beside each rank's
measured median step time. Layouts alternate (ep2 zero3, zero3 ep2, ...) so drift hits both.
Goal: each prediction within +-25 % of the measured tokens/s.

Harness vs raw (bench/overhead.py's method, EP layout only): the same run's ds_config.json and recipe.json replayed
by bench/raw_deepspeed.py (forward / backward / step, nothing else); tokens/s over the steps after the warm-up,
losses must agree step for step. Goal: harness / raw >= 0.98 (median over --pairs).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from overhead import check_same_work, deepspeed, fail  # noqa: E402
from time_model import calibrate, make_model  # noqa: E402

# Mixtral, not Qwen3-MoE: transformers 5.24 saves Qwen3-MoE's num_experts as num_local_experts, which the run's
# MoE checks (harness/model/moe/families.py, moe-core) do not read yet
MODEL = {"model_type": "mixtral", "vocab_size": 512, "hidden_size": 256, "intermediate_size": 256,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 8,
         "num_experts_per_tok": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
         "tie_word_embeddings": False}
SEQ_LEN, MICRO = 128, 4  # 2 ranks x 4 = 8 sequences per step
LAYOUTS = {"ep2": ["--recipe", "zero2", "--set", "parallel.expert=2"], "zero3": ["--recipe", "zero3"]}
TOLERANCE, GOAL = 0.25, 0.98


def run_layout(name: str, model: Path, run_dir: Path, steps: int, warmup: int, hardware: Path | None) -> dict:
    import os

    if hardware is not None:
        os.environ["HARNESS_HARDWARE"] = str(hardware)
    shutil.rmtree(run_dir, ignore_errors=True)
    proc = deepspeed(2, "harness/run.py", *LAYOUTS[name], "--model", str(model), "--output-dir", str(run_dir),
                     "--set", f"train.steps={steps}", "--set", f"train.seq_len={SEQ_LEN}",
                     "--set", f"batch.micro_batch_per_gpu={MICRO}", "--set", "batch.grad_accum_steps=1",
                     "--set", "batch.train_batch_size=auto", "--set", "train.eval_every=0", "--set", "precision=fp32",
                     "--profile-steps", "")
    if not (run_dir / "summary.json").is_file():
        raise fail(proc)
    summary = json.loads((run_dir / "summary.json").read_text())
    train = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]
    tokens_per_step = train[0]["tokens_per_s"] * train[0]["step_time_s"]
    timed = train[warmup:]
    wall_s = train[-1]["time"] - train[warmup - 1]["time"]
    st = summary["throughput"]["step_time"]
    measured_s = max(st["measured_median_s_per_rank"])
    return {"layout": name, "tokens_per_step": tokens_per_step, "measured_s": measured_s,
            "wall_tokens_per_s": tokens_per_step * len(timed) / wall_s, "predicted_s": st.get("step_time_s"),
            "breakdown": st.get("breakdown", {}), "note": st.get("note"), "loss": [r["loss"] for r in train]}


def run_raw(run_dir: Path, steps: int, warmup: int) -> dict:
    proc = deepspeed(2, "bench/raw_deepspeed.py", "--run-dir", str(run_dir), "--steps", str(steps),
                     "--warmup-steps", str(warmup))
    lines = [line for line in proc.stdout.splitlines() if line.startswith('{"raw"')]
    if proc.returncode != 0 or not lines:
        raise fail(proc)
    return json.loads(lines[0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=2, help="runs of each layout (alternating order)")
    parser.add_argument("--hardware", help="a calibrated profile (default: calibrate now; 'none': measure only, "
                                           "no prediction)")
    parser.add_argument("--work", default="/tmp/dsharness-bench-moe")
    parser.add_argument("--skip-raw", action="store_true")
    args = parser.parse_args()
    work = Path(args.work)
    model = work / "mixtral-7m"
    make_model(model, MODEL)
    print("uptime before:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(), flush=True)
    hardware = Path(args.hardware) if args.hardware else work / "hardware.json"
    if args.hardware == "none":
        hardware = None
    elif not args.hardware:
        calibrate(model, hardware, "fp32")
    runs: dict[str, list[dict]] = {"ep2": [], "zero3": []}
    ratios = []
    for i in range(args.pairs):
        for name in (("ep2", "zero3") if i % 2 == 0 else ("zero3", "ep2")):
            start = time.time()
            run_dir = work / name
            r = run_layout(name, model, run_dir, args.steps, args.warmup_steps, hardware)
            runs[name].append(r)
            line = (f"{name:<6} run {len(runs[name])}: measured {r['measured_s']:.3f} s/step, predicted "
                    f"{r['predicted_s'] or float('nan'):.3f}")
            if name == "ep2" and not args.skip_raw:
                raw = run_raw(run_dir, args.steps, args.warmup_steps)
                check_same_work({"loss": r["loss"]}, raw)
                ratios.append(r["wall_tokens_per_s"] / raw["tokens_per_s"])
                line += (f"; harness {r['wall_tokens_per_s']:.0f} tok/s vs raw AutoEP {raw['tokens_per_s']:.0f} "
                         f"tok/s = {ratios[-1]:.3f}")
            print(f"{line}  [{time.time() - start:.0f} s]", flush=True)
            shutil.rmtree(run_dir, ignore_errors=True)
    print("uptime after: ", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    ok = True
    for name, rs in runs.items():
        measured = statistics.mean(r["measured_s"] for r in rs)
        predicted = rs[0]["predicted_s"]
        tokens = rs[0]["tokens_per_step"]
        if predicted is None:
            print(f"{name}: no prediction ({rs[0]['note']})")
            ok = False
            continue
        err = predicted / measured - 1
        ok &= abs(err) <= TOLERANCE
        terms = ", ".join(f"{k.removesuffix('_s')} {v:.3f}" for k, v in rs[0]["breakdown"].items() if v)
        print(f"{name:<6} tokens/s measured {tokens / measured:8.0f}  predicted {tokens / predicted:8.0f}  "
              f"(step {measured:.3f} s vs {predicted:.3f} s, error {err:+.0%})\n         {terms}")
    if ratios:
        ratio = statistics.median(ratios)
        ok &= ratio >= GOAL
        print(f"harness / raw DeepSpeed AutoEP (ep2): median {ratio:.3f} over {len(ratios)} ({', '.join(f'{x:.3f}' for x in ratios)}); goal >= {GOAL}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
