"""MoE on 2 CPU ranks: expert parallelism (DeepSpeed AutoEP) against ZeRO-3 with leaves, measured and predicted, and
the harness against a raw DeepSpeed AutoEP loop on the same config (issue #26).

    python bench/moe.py --part calibrate               # once: `harness calibrate` at the model's shapes (50-95 s)
    python bench/moe.py --part layouts [--pairs 2]     # ep2 / zero3 alternating, prediction vs measured (~55 s a pair)
    python bench/moe.py --part raw [--pairs 2]         # harness ep2 / raw AutoEP alternating (~55 s a pair)
    python bench/moe.py --part report                  # the tables over every run recorded so far
    (--part all: the three in one go, for a machine nobody shares; --fresh forgets earlier records)

Each part fits one 5-minute hold of a shared machine; layouts and raw append their runs to --work/layouts.jsonl and
raw.jsonl and continue the alternation where the last invocation stopped, so repeated invocations add pairs.

Model: a random-weight Mixtral of ~7.4M parameters (8 routed experts, top 2, 4 sparse blocks, hidden 256, the
built-in tokenizer) saved into --work. Layouts, same global batch (8 x 128 tokens, fp32):
  ep2     --recipe zero2 --set parallel.expert=2  (AutoEP, 4 experts per rank, DeepSpeed's loop over them on CPU)
  zero3   --recipe zero3                          (the harness's leaf table: one sparse block gathered at once)
Each run records its own prediction (summary.json throughput.step_time: the planner's step time for this very
layout on the calibrated profile) beside each rank's measured median step time; the slowest rank's is compared.
Goal: predicted tokens/s within +-25 % of measured, per layout (median over the runs).

Harness vs raw (bench/overhead.py's method, EP layout only): the harness run's ds_config.json (with its
expert_parallel block) and recipe.json replayed by bench/raw_deepspeed.py on the same rows (forward / backward /
step, nothing else); tokens/s over the steps after the warm-up on both sides, losses agree step for step.
Goal: harness / raw >= 0.98, the median over the pairs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from overhead import check_same_work, deepspeed, fail, quantile  # noqa: E402
from time_model import make_model  # noqa: E402

# Mixtral, not Qwen3-MoE: transformers 5.24 saves Qwen3-MoE's num_experts as num_local_experts
MODEL = {"model_type": "mixtral", "vocab_size": 512, "hidden_size": 256, "intermediate_size": 256,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 8,
         "num_experts_per_tok": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
         "tie_word_embeddings": False}
SEQ_LEN, MICRO = 128, 4  # 2 ranks x 4 = 8 sequences per step
LAYOUTS = {"ep2": ["--recipe", "zero2", "--set", "parallel.expert=2"], "zero3": ["--recipe", "zero3"]}
TOLERANCE, GOAL = 0.25, 0.98


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip().split("load average: ")[-1]


def calibrate(work: Path) -> None:
    cmd = [sys.executable, "-m", "harness.cli", "calibrate", "--model", str(work / "mixtral-7m"), "--seq-len",
           str(SEQ_LEN), "--micro-batch", str(MICRO), "--ranks", "2", "--precision", "fp32",
           "--out", str(work / "hardware.json")]
    subprocess.run(cmd, cwd=ROOT, check=True, env=dict(os.environ, PATH=f"{Path(sys.executable).parent}"
                                                                          f"{os.pathsep}{os.environ['PATH']}"))


def run_harness(name: str, work: Path, run_dir: Path, steps: int, warmup: int, hardware: Path | None) -> dict:
    if hardware is not None:
        os.environ["HARNESS_HARDWARE"] = str(hardware)
    shutil.rmtree(run_dir, ignore_errors=True)
    proc = deepspeed(2, "harness/run.py", *LAYOUTS[name], "--model", str(work / "mixtral-7m"),
                     "--output-dir", str(run_dir), "--set", f"train.steps={steps}", "--set", f"train.seq_len={SEQ_LEN}",
                     "--set", f"batch.micro_batch_per_gpu={MICRO}", "--set", "batch.grad_accum_steps=1",
                     "--set", "batch.train_batch_size=auto", "--set", "train.eval_every=0", "--set", "precision=fp32",
                     "--profile-steps", "")
    if not (run_dir / "summary.json").is_file():
        raise fail(proc)
    summary = json.loads((run_dir / "summary.json").read_text())
    train = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]
    tokens_per_step = train[0]["tokens_per_s"] * train[0]["step_time_s"]
    wall_s = train[-1]["time"] - train[warmup - 1]["time"]  # each step's end, rounded to 1 ms
    st = summary["throughput"]["step_time"]
    return {"layout": name, "tokens_per_step": tokens_per_step, "measured_s": max(st["measured_median_s_per_rank"]),
            "wall_tokens_per_s": tokens_per_step * (len(train) - warmup) / wall_s,
            "step_s": [b["time"] - a["time"] for a, b in zip(train[warmup - 1:], train[warmup:])],
            "predicted_s": st.get("step_time_s"), "breakdown": st.get("breakdown", {}), "note": st.get("note"),
            "loss": [r["loss"] for r in train]}


def run_raw(run_dir: Path, steps: int, warmup: int) -> dict:
    proc = deepspeed(2, "bench/raw_deepspeed.py", "--run-dir", str(run_dir), "--steps", str(steps),
                     "--warmup-steps", str(warmup))
    lines = [line for line in proc.stdout.splitlines() if line.startswith('{"raw"')]
    if proc.returncode != 0 or not lines:
        raise fail(proc)
    return json.loads(lines[0])


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def append(path: Path, row: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")


def part_layouts(args, work: Path) -> None:
    hardware = Path(args.hardware) if args.hardware else work / "hardware.json"
    if not hardware.is_file():
        raise SystemExit(f"{hardware}: no hardware profile; run --part calibrate first (or give --hardware FILE)")
    store = work / "layouts.jsonl"
    done = len(records(store)) // 2
    for i in range(done, done + args.pairs):
        for name in (("ep2", "zero3") if i % 2 == 0 else ("zero3", "ep2")):
            start, load = time.time(), uptime()
            r = run_harness(name, work, work / name, args.steps, args.warmup_steps, hardware)
            r.update(pair=i + 1, load_before=load)
            r.pop("loss")
            append(store, r)
            print(f"{name:<6} pair {i + 1}: measured {r['measured_s']:.3f} s/step, predicted "
                  f"{r['predicted_s'] or float('nan'):.3f}  [{time.time() - start:.0f} s, load {load}]", flush=True)
            shutil.rmtree(work / name, ignore_errors=True)


def part_raw(args, work: Path) -> None:
    store, config = work / "raw.jsonl", work / "raw-config"
    done = len(records(store))
    for i in range(done, done + args.pairs):
        start, load = time.time(), uptime()
        order = ("harness", "raw") if i % 2 == 0 or not (config / "ds_config.json").is_file() else ("raw", "harness")
        got = {}
        for arm in order:
            if arm == "harness":
                got[arm] = run_harness("ep2", work, work / "ep2-raw", args.raw_steps, args.warmup_steps, None)
                config.mkdir(exist_ok=True)
                for f in ("ds_config.json", "recipe.json"):  # what the raw arm replays
                    shutil.copy(work / "ep2-raw" / f, config / f)
                shutil.rmtree(work / "ep2-raw", ignore_errors=True)
            else:
                got[arm] = run_raw(config, args.raw_steps, args.warmup_steps)
        h, r = got["harness"], got["raw"]
        raw_steps = r["step_time_s"][args.warmup_steps:]
        row = {"pair": i + 1, "order": "-".join(order), "harness": h["wall_tokens_per_s"], "raw": r["tokens_per_s"],
               "ratio": h["wall_tokens_per_s"] / r["tokens_per_s"],
               "ratio_median_step": statistics.median(raw_steps) / statistics.median(h["step_s"]),
               "ratio_p20_step": quantile(raw_steps, 0.2) / quantile(h["step_s"], 0.2),
               "loss_rel_diff": check_same_work(h, r), "load_before": load,
               "expert_parallel": json.loads((config / "ds_config.json").read_text())["expert_parallel"]}
        append(store, row)
        print(f"pair {row['pair']} ({row['order']}): harness {row['harness']:.0f} tok/s, raw AutoEP {row['raw']:.0f} "
              f"tok/s, ratio {row['ratio']:.3f} (median step {row['ratio_median_step']:.3f}); losses agree within "
              f"{row['loss_rel_diff']:.1e}  [{time.time() - start:.0f} s, load {load}]", flush=True)


def report(work: Path) -> bool:
    ok = True
    runs = records(work / "layouts.jsonl")
    if runs:
        print("| layout | runs | measured tokens/s | predicted tokens/s | predicted / measured | step s measured "
              "(each run) | predicted terms (s) |\n|---|---|---|---|---|---|---|")
    for name in LAYOUTS:
        mine = [r for r in runs if r["layout"] == name]
        if not mine:
            continue
        tokens = mine[0]["tokens_per_step"]
        measured = statistics.median(r["measured_s"] for r in mine)
        predicted = statistics.median(r["predicted_s"] for r in mine if r["predicted_s"]) if any(
            r["predicted_s"] for r in mine) else None
        if predicted is None:
            print(f"| {name} | {len(mine)} | {tokens / measured:.0f} | none ({mine[0]['note']}) | | | |")
            ok = False
            continue
        ratio = measured / predicted  # predicted tokens/s over measured
        ok &= abs(ratio - 1) <= TOLERANCE
        terms = ", ".join(f"{k.removesuffix('_s')} {v:.3f}" for k, v in mine[-1]["breakdown"].items() if v)
        each = " ".join(f"{r['measured_s']:.3f}" for r in mine)
        print(f"| {name} | {len(mine)} | {tokens / measured:.0f} | {tokens / predicted:.0f} | {ratio:.2f} | {each} | "
              f"{terms} |")
    if runs and (work / "hardware.json").is_file():  # the calibrated residuals the predictions lean on most
        m = json.loads((work / "hardware.json").read_text())["measured"]
        print("calibration: ZeRO hooks per tensor and micro-step " + ", ".join(
            f"ZeRO-{k} {v * 1e3:.2f} ms" for k, v in m.get("zero_overhead_s_per_tensor", {}).items())
              + "; optimizer " + ", ".join(f"ZeRO-{k} {v / 1e6:.0f} M params/s"
                                           for k, v in m.get("optimizer_params_per_s", {}).items()))
    pairs = records(work / "raw.jsonl")
    if pairs:
        print("\n| pair | order | harness tok/s | raw AutoEP tok/s | ratio | ratio of median steps | load before |\n"
              "|---|---|---|---|---|---|---|")
        for p in pairs:
            print(f"| {p['pair']} | {p['order']} | {p['harness']:.0f} | {p['raw']:.0f} | {p['ratio']:.3f} | "
                  f"{p['ratio_median_step']:.3f} | {p['load_before']} |")
        ratio = statistics.median(p["ratio"] for p in pairs)
        ok &= ratio >= GOAL
        print(f"harness / raw DeepSpeed AutoEP: median {ratio:.3f} over {len(pairs)} pairs (median-step ratio "
              f"{statistics.median(p['ratio_median_step'] for p in pairs):.3f}); goal >= {GOAL}; same expert_parallel "
              f"block both sides: {pairs[-1]['expert_parallel']}")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("calibrate", "layouts", "raw", "report", "all"), default="report")
    parser.add_argument("--steps", type=int, default=10, help="steps of a layouts run")
    parser.add_argument("--raw-steps", type=int, default=16, help="steps of each arm of a raw pair")
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=2, help="pairs to add in this invocation")
    parser.add_argument("--hardware", help="a calibrated profile (default: --work/hardware.json)")
    parser.add_argument("--work", default="/tmp/dsharness-bench-moe")
    parser.add_argument("--fresh", action="store_true", help="forget the runs recorded in --work")
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.fresh:
        for f in ("layouts.jsonl", "raw.jsonl"):
            (work / f).unlink(missing_ok=True)
        shutil.rmtree(work / "raw-config", ignore_errors=True)
    make_model(work / "mixtral-7m", MODEL)
    if args.part in ("calibrate", "all"):
        calibrate(work)
    if args.part in ("layouts", "all"):
        part_layouts(args, work)
    if args.part in ("raw", "all"):
        part_raw(args, work)
    return 0 if report(work) or args.part == "calibrate" else 1


if __name__ == "__main__":
    sys.exit(main())
