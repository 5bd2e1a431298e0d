"""The harness's GRPO against TRL 1.16's GRPOTrainer on the same CPU job, back to back: the built-in toy task
(harness/rl/toy.py: reply in vowels), the built-in tiny Llama's seeded weights saved to one folder both load, the
same hyperparameters (dapo, beta 0, num_generations 4, 16 completions per step, max_completion_length 8, AdamW lr 1e-2,
no weight decay, clipping 1.0, constant lr, temperature 1).

    python bench/rl.py [--steps 30] [--pairs 1] [--ranks 1] [--recipe ddp]

Reported per side: the reward curve (mean of the first and last 5 steps), tokens/s (prompt + completion tokens the
steps processed / the training loop's wall time: TRL's train_runtime, the harness's first-to-last step end plus the
first step), and the harness's time split (generate / score / reference / train / sync, share of the step) and its
per-rank peak memory beside the planner's prediction (the run's own start-up lines). Goal: harness / TRL tokens/s
>= 1.0. trl is not a dependency of the harness: `pip install --no-deps trl==1.16.0` (it pulls no other torch then).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from harness.dist import free_port  # noqa: E402

BIN = Path(sys.executable).parent
HYPER = {"num_generations": 4, "batch": 16, "max_completion_length": 8, "lr": 1e-2, "clip": 1.0, "temperature": 1.0}


def env() -> dict:
    out = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    out["PATH"] = f"{BIN}{os.pathsep}{out.get('PATH', '')}"
    return out


def model_folder(root: Path) -> str:
    from harness.model.hf import build_model, load_tokenizer

    folder = root / "tiny-llama"
    build_model("tiny-llama", seed=1234).save_pretrained(folder)
    load_tokenizer("tiny-llama").save_pretrained(folder)
    return str(folder)


TRL_SCRIPT = r"""
import json, sys, time
sys.path.insert(0, sys.argv[4])
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer
from transformers import AutoTokenizer
from harness.rl import toy
folder, steps, hyper = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
args = GRPOConfig(output_dir=folder + "/trl_out", use_cpu=True, per_device_train_batch_size=hyper["batch"],
                  num_generations=hyper["num_generations"], max_completion_length=hyper["max_completion_length"],
                  learning_rate=hyper["lr"], max_steps=steps, logging_steps=1, report_to=[], save_strategy="no",
                  lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=hyper["clip"], seed=0,
                  bf16=False, loss_type="dapo", beta=0.0, temperature=hyper["temperature"], disable_tqdm=True)
trainer = GRPOTrainer(model=folder, reward_funcs=[toy.vowels], args=args,
                      train_dataset=Dataset.from_list(toy.records()), processing_class=AutoTokenizer.from_pretrained(folder))
began = time.perf_counter()
trainer.train()
logs = [h for h in trainer.state.log_history if "reward" in h]
print(json.dumps({"rewards": [h["reward"] for h in logs], "tokens": logs[-1]["num_tokens"],
                  "seconds": time.perf_counter() - began}))
"""


def run_trl(folder: str, steps: int) -> dict:
    proc = subprocess.run([sys.executable, "-c", TRL_SCRIPT, folder, str(steps), json.dumps(HYPER), str(ROOT)],
                          capture_output=True, text=True, env=env(), timeout=3600)
    if proc.returncode:
        raise SystemExit(f"TRL exited {proc.returncode}\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def harness_argv(folder: str, out: Path, steps: int, recipe: str, ranks: int) -> list[str]:
    sets = {"train.model": folder, "train.objective": "grpo", "train.steps": steps, "precision": "fp32",
            "batch.micro_batch_per_gpu": HYPER["batch"] // ranks, "batch.grad_accum_steps": 1,
            "batch.train_batch_size": '"auto"', "optimizer.type": "adamw", "optimizer.lr": HYPER["lr"],
            "optimizer.weight_decay": 0, "scheduler.type": "none", "gradient_clipping": HYPER["clip"],
            "rl.num_generations": HYPER["num_generations"], "rl.max_completion_length": HYPER["max_completion_length"],
            "rl.temperature": HYPER["temperature"], "train.log_every": 1, "train.save_every": 0}
    argv = ["--recipe", recipe, "--output-dir", str(out), "--overwrite", "--profile-steps", ""]
    for key, value in sets.items():
        argv += ["--set", f"{key}={value}"]
    return argv


def run_harness(folder: str, out: Path, steps: int, recipe: str, ranks: int) -> dict:
    cmd = [str(BIN / "deepspeed"), "--master_port", str(free_port()), "--num_gpus", str(ranks), "harness/run.py",
           *harness_argv(folder, out, steps, recipe, ranks)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=3600)
    if proc.returncode:
        raise SystemExit(f"harness exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    rollouts = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    tokens = sum(len(r["prompt_ids"]) + _kept(r["completion_ids"]) for r in rollouts)
    seconds = train[-1]["time"] - train[0]["time"] + train[0]["step_time_s"]
    split = {k: statistics.mean(r[f"time/{k}_s"] for r in train) for k in ("generate", "score", "reference", "train",
                                                                          "sync")}
    memory = [line for line in proc.stdout.splitlines() if line.startswith("[memory]")]
    return {"rewards": [r["reward"] for r in train], "tokens": tokens, "seconds": seconds, "split": split,
            "memory": memory}


def _kept(ids: list[int]) -> int:
    return ids.index(0) + 1 if 0 in ids else len(ids)


def curve(rewards: list[float]) -> str:
    return f"{statistics.mean(rewards[:5]):.3f} -> {statistics.mean(rewards[-5:]):.3f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--pairs", type=int, default=1, help="back-to-back (harness, TRL) pairs; ratios' median")
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--recipe", default="ddp")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench_rl_"))
    folder = model_folder(root)
    ratios = []
    for pair in range(args.pairs):
        ours = run_harness(folder, root / f"harness{pair}", args.steps, args.recipe, args.ranks)
        theirs = run_trl(folder, args.steps)
        ours_tps, theirs_tps = ours["tokens"] / ours["seconds"], theirs["tokens"] / theirs["seconds"]
        ratios.append(ours_tps / theirs_tps)
        print(f"pair {pair}: harness ({args.recipe}, {args.ranks} rank(s)) reward {curve(ours['rewards'])}, "
              f"{ours_tps:,.0f} tok/s | TRL {trl_version()} reward {curve(theirs['rewards'])}, {theirs_tps:,.0f} "
              f"tok/s | ratio {ratios[-1]:.2f}")
        step = sum(ours["split"].values())
        print("  harness time split per step: " + ", ".join(f"{k} {v * 1000:.0f} ms ({v / step:.0%})"
                                                            for k, v in ours["split"].items()))
        for line in ours["memory"]:
            print(f"  {line}")
    print(f"harness / TRL tokens/s: median {statistics.median(ratios):.2f} over {len(ratios)} pair(s) (goal >= 1.0)")
    return 0


def trl_version() -> str:
    import trl

    return trl.__version__


if __name__ == "__main__":
    time.sleep(0)
    sys.exit(main())
