"""The step-time model on this machine: predicted vs measured step time for seven recipes on 2 CPU ranks.

Builds a Llama-shaped model of ~24M parameters (random weights, the built-in tokenizer) into a folder, runs
`harness calibrate` at its shapes (unless --hardware FILE is given), then trains each recipe for a few steps
with that profile ($HARNESS_HARDWARE) and reads what the run recorded (summary.json throughput.step_time):
the prediction and each rank's measured median step time. Every recipe trains the same global batch.

    python bench/time_model.py [--steps 8] [--hardware FILE] [--recipes ddp,zero1,...] [--precision fp32]

fp32 by default: on a CPU without bf16 instructions (AVX2-only, as this machine) torch's bf16 GEMM is emulated,
~1 GFLOP/s against ~21 GFLOP/s in fp32 on one core, so a bf16 step is all compute and every layout times alike.

Every recipe runs twice, in the order given and then reversed (A B .. G G .. B A), so drift of the machine
over the minutes of the bench falls on all recipes alike; the measured time is the mean of the two medians.
Pass: each prediction within +-25 % of the measured time, and the order by measured speed equal to the
predicted order except between recipes whose measured times lie within the noise of each other (the larger of
10 %, the step-to-step spread, and each recipe's difference between its two runs). Reports `uptime` before
and after: on a loaded machine the numbers say more about the other tenants than about the model.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from helpers.launch import launch  # noqa: E402

MODEL = {"model_type": "llama", "vocab_size": 512, "hidden_size": 512, "intermediate_size": 1408,
         "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 512,
         "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
SEQ_LEN, GLOBAL_BATCH = 256, 8
BATCH = {  # recipe -> (micro-batch, accumulation): 8 sequences per step on 2 ranks for every layout
    "ddp": (4, 1), "zero1": (4, 1), "zero2": (4, 1), "zero3": (4, 1), "zero2_offload": (4, 1),
    "tp": (4, 2), "pipeline": (2, 4)}
TOLERANCE, NOISE = 0.25, 0.10


def make_model(folder: Path, shape: dict = MODEL) -> None:
    """A random-weight model of `shape` with the built-in tokenizer, saved into `folder` (once)."""
    import torch
    import transformers

    if (folder / "config.json").exists():
        return
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**shape))
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "harness" / "assets" / name, folder / name)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M params in {folder}")


def calibrate(model: Path, out: Path, precision: str) -> None:
    cmd = [sys.executable, "-m", "harness.cli", "calibrate", "--model", str(model), "--seq-len", str(SEQ_LEN),
           "--micro-batch", "4", "--ranks", "2", "--precision", precision, "--out", str(out)]
    subprocess.run(cmd, cwd=ROOT, check=True)


def run_recipe(recipe: str, model: Path, work: Path, steps: int, hardware: Path, precision: str) -> dict:
    micro, accum = BATCH[recipe]
    out = work / recipe
    shutil.rmtree(out, ignore_errors=True)
    os.environ["HARNESS_HARDWARE"] = str(hardware)
    launch("--recipe", recipe, "--model", str(model), "--output-dir", str(out), "--set", f"train.steps={steps}",
           "--set", f"train.seq_len={SEQ_LEN}", "--set", f"batch.micro_batch_per_gpu={micro}",
           "--set", f"batch.grad_accum_steps={accum}", "--set", "batch.train_batch_size=auto",
           "--set", "train.eval_every=0", "--set", "profile.steps=", "--set", f"precision={precision}", timeout_s=1800)
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    tokens = GLOBAL_BATCH * SEQ_LEN
    step_s = sorted(tokens / r["tokens_per_s"] for r in rows if r.get("kind") == "train" and r["step"] > 1)
    st = summary["throughput"]["step_time"]
    shutil.rmtree(out, ignore_errors=True)
    spread = (step_s[-1] - step_s[0]) / (2 * step_s[len(step_s) // 2]) if step_s else 0.0
    measured = max(st["measured_median_s_per_rank"])
    return {"recipe": recipe, "predicted_s": st.get("step_time_s"), "measured_s": measured, "spread": spread,
            "breakdown": st.get("breakdown", {}), "note": st.get("note")}


def order_ok(results: list[dict]) -> list[str]:
    """Pairs ordered differently by prediction and measurement whose measured times differ beyond the noise."""
    bad = []
    for i, a in enumerate(results):
        for b in results[i + 1:]:
            noise = max(NOISE, a["spread"], b["spread"])
            gap = abs(a["measured_s"] - b["measured_s"]) / min(a["measured_s"], b["measured_s"])
            if gap > noise and (a["measured_s"] < b["measured_s"]) != (a["predicted_s"] < b["predicted_s"]):
                bad.append(f"{a['recipe']} vs {b['recipe']}: measured {a['measured_s']:.3f} / {b['measured_s']:.3f} s, "
                           f"predicted {a['predicted_s']:.3f} / {b['predicted_s']:.3f} s")
    return bad


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--hardware", help="a calibrated profile (default: calibrate now)")
    parser.add_argument("--recipes", default=",".join(BATCH))
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--work", default="/tmp/dsharness-time-model")
    args = parser.parse_args()
    work = Path(args.work)
    model = work / "llama-24m"
    make_model(model)
    print("uptime before:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    hardware = Path(args.hardware) if args.hardware else work / "hardware.json"
    if not args.hardware:
        calibrate(model, hardware, args.precision)
    recipes = args.recipes.split(",")
    runs: dict[str, list[dict]] = {}
    for recipe in recipes + recipes[::-1]:
        start = time.time()
        r = run_recipe(recipe, model, work, args.steps, hardware, args.precision)
        runs.setdefault(recipe, []).append(r)
        print(f"{recipe:<14} run {len(runs[recipe])}: measured {r['measured_s']:7.3f} s (spread +-{r['spread']:.0%})"
              f"  [{time.time() - start:.0f} s]", flush=True)
    results = []
    for recipe in recipes:
        a, b = runs[recipe]
        drift = abs(a["measured_s"] - b["measured_s"]) / (a["measured_s"] + b["measured_s"])
        r = dict(a, measured_s=(a["measured_s"] + b["measured_s"]) / 2, spread=max(a["spread"], b["spread"], drift))
        results.append(r)
        err = r["measured_s"] / r["predicted_s"] - 1 if r["predicted_s"] else float("nan")
        print(f"{recipe:<14} predicted {r['predicted_s'] or float('nan'):7.3f} s  measured {r['measured_s']:7.3f} s "
              f"(runs {a['measured_s']:.3f} / {b['measured_s']:.3f}, noise +-{r['spread']:.0%})  error {err:+.0%}",
              flush=True)
    print("uptime after: ", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    within = [r for r in results if r["predicted_s"] and abs(r["measured_s"] / r["predicted_s"] - 1) <= TOLERANCE]
    bad_order = order_ok(results)
    print(f"within +-{TOLERANCE:.0%}: {len(within)}/{len(results)}; order disagreements beyond noise: "
          f"{len(bad_order)}")
    for line in bad_order:
        print("  " + line)
    for r in results:
        terms = ", ".join(f"{k.removesuffix('_s')} {v:.3f}" for k, v in r["breakdown"].items() if v)
        print(f"  {r['recipe']}: {terms}")
    return 0 if len(within) == len(results) and not bad_order else 1


if __name__ == "__main__":
    sys.exit(main())
