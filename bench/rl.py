"""The harness's GRPO against TRL 1.16's GRPOTrainer on the same CPU job, back to back: the built-in toy task
(harness/rl/toy.py: reply in vowels), the built-in tiny Llama's seeded weights saved to one folder both load, the
same hyperparameters (dapo, beta 0, num_generations 4, 16 completions per step, max_completion_length 8, AdamW lr 1e-2,
no weight decay, clipping 1.0, constant lr, temperature 1).

    python bench/rl.py [--steps 20] [--pairs 3] [--ranks 1] [--recipe ddp]      (~1 min a pair on 2 idle cores)

Pairs run back to back in alternating order (H T, T H, H T, ...), so drift on a shared machine hits both sides.
Reported per pair and side: the reward curve (mean of the first and last 5 steps), tokens/s (prompt + completion
tokens the steps processed / the training loop's wall time: around TRL's trainer.train(), the harness's first-to-last
step end plus the first step) and the median step time (TRL's own step_time metric; the harness's step_time_s); the
ratios harness / TRL of both, the loop's and the median step's (tokens/s of each step, the first left out: a load
burst moves a median much less than a sum). Then the median ratio over the pairs and its spread (range; +- half the
range over the median), the harness's time split (generate / score / reference / train / sync: median per step,
share of the step) and its per-rank peak memory beside the planner's prediction (the run's own start-up lines).
Goal: harness / TRL tokens/s >= 1.0. trl is not a dependency of the harness: `pip install --no-deps trl==1.16.0` (it pulls no other torch then).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
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
                  "num_tokens": [h["num_tokens"] for h in logs], "step_times": [h["step_time"] for h in logs],
                  "seconds": time.perf_counter() - began}))
"""


def run_trl(folder: str, steps: int) -> dict:
    proc = subprocess.run([sys.executable, "-c", TRL_SCRIPT, folder, str(steps), json.dumps(HYPER), str(ROOT)],
                          capture_output=True, text=True, env=env(), timeout=3600)
    if proc.returncode:
        raise SystemExit(f"TRL exited {proc.returncode}\n{proc.stderr[-4000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    seen = [0] + out["num_tokens"]  # cumulative prompt + completion tokens, per logged step
    out["step_tps"] = [(b - a) / t for a, b, t in zip(seen, seen[1:], out["step_times"])]
    return out


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
    split = {k: statistics.median(r[f"time/{k}_s"] for r in train) for k in SPLIT}
    memory = [line for line in proc.stdout.splitlines() if line.startswith("[memory]")]
    return {"rewards": [r["reward"] for r in train], "tokens": tokens, "seconds": seconds, "split": split,
            "step_s": statistics.median(r["step_time_s"] for r in train),
            "step_tps": [r["tokens_per_s"] for r in train], "memory": memory}


SPLIT = ("generate", "score", "reference", "train", "sync")


def _kept(ids: list[int]) -> int:
    return ids.index(0) + 1 if 0 in ids else len(ids)


def curve(rewards: list[float]) -> str:
    return f"{statistics.mean(rewards[:5]):.3f} -> {statistics.mean(rewards[-5:]):.3f}"


def spread(ratios: list[float]) -> str:
    med = statistics.median(ratios)
    return f"median {med:.2f}, range {min(ratios):.2f}-{max(ratios):.2f} (+-{(max(ratios) - min(ratios)) / 2 / med:.0%})"


def one_pair(pair: int, folder: str, root: Path, args) -> tuple[dict, dict]:
    """Harness then TRL on even pairs, TRL then harness on odd ones (H T, T H, H T, ...): drift on a shared
    machine hits both sides alike."""
    sides = {}
    for side in (("harness", "trl") if pair % 2 == 0 else ("trl", "harness")):
        sides[side] = run_harness(folder, root / f"harness{pair}", args.steps, args.recipe, args.ranks) \
            if side == "harness" else run_trl(folder, args.steps)
    return sides["harness"], sides["trl"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--pairs", type=int, default=3, help="back-to-back pairs, in the order H T, T H, H T, ...")
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--recipe", default="ddp")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench_rl_"))
    folder = model_folder(root)
    wall, per_step, splits, trl_steps = [], [], [], []
    for pair in range(args.pairs):
        ours, theirs = one_pair(pair, folder, root, args)
        ours_tps, theirs_tps = ours["tokens"] / ours["seconds"], theirs["tokens"] / theirs["seconds"]
        wall.append(ours_tps / theirs_tps)
        # the median step's tokens/s (warm-up step left out): what a load burst on a shared machine moves least
        per_step.append(statistics.median(ours["step_tps"][1:]) / statistics.median(theirs["step_tps"][1:]))
        splits.append(ours["split"])
        trl_steps.append(statistics.median(theirs["step_times"][1:]))
        order = "H T" if pair % 2 == 0 else "T H"
        print(f"pair {pair} ({order}): harness ({args.recipe}, {args.ranks} rank(s)) reward {curve(ours['rewards'])}, "
              f"{ours_tps:,.0f} tok/s, median step {ours['step_s'] * 1000:.0f} ms | TRL {trl_version()} reward "
              f"{curve(theirs['rewards'])}, {theirs_tps:,.0f} tok/s, median step {trl_steps[-1] * 1000:.0f} ms | "
              f"ratio {wall[-1]:.2f} (loop), {per_step[-1]:.2f} (median step)")
        if pair == 0:
            for line in ours["memory"]:
                print(f"  {line}")
    split = {k: statistics.median(s[k] for s in splits) for k in SPLIT}
    step = sum(split.values())
    print("harness time split per step (median over steps and runs): " + ", ".join(
        f"{k} {v * 1000:.1f} ms ({v / step:.0%})" for k, v in split.items()) +
        f"; TRL's median step {statistics.median(trl_steps) * 1000:.0f} ms (generation, scoring and update)")
    print(f"harness / TRL tokens/s over the training loop: {spread(wall)} over {len(wall)} pair(s) (goal >= 1.0)")
    print(f"harness / TRL tokens/s of the median step:     {spread(per_step)}")
    return 0


def trl_version() -> str:
    import trl

    return trl.__version__


if __name__ == "__main__":
    sys.exit(main())
