"""Tool-use rollouts per second beside single-turn GRPO on the same model, prompts and budget, in one run.

The model is the tool-calling tiny Llama of tests/helpers/tool_models.py (the built-in BPE tokenizer under Qwen2.5's
template, the Hermes calls as tokens); the prompts are tests' SecretEnv conversations (~700 tokens with the tool
schema). Two runs of harness/run.py back to back (then again in the other order, --pairs times), the same
hyperparameters (32 rollouts a step: 4 prompts x 8, max_completion_length 160, AdamW lr 5e-3, fp32, ZeRO-2):
- tools: rl.environment_factory SecretEnv (tests/fixtures/rl_tools/secret_env.py), max_tool_calling_iterations 3;
- single: no tools (the same prompt rendered without schemas is shorter: its own prompt tokens are counted), the
  reward harness.rl.toy:vowels.
Reported per run (median over the steps, the first left out): rollouts/s of the rollout phase (rollouts / (time/
generate_s + time/tools_s)), sampled tokens/s of generation (the tokens the model generated / time/generate_s),
all tokens/s of the rollout phase (prompt + completion, tool tokens included / the phase), generate calls per
rollout (turns), and the split of the rollout phase: generate vs tools (environments' reset, tool calls, parsing
and rendering the tool suffixes: time/tools_s); then the step's split (generate / tools / score / train).

    python bench/rl_tools.py [--steps 6] [--pairs 1] [--ranks 1]      (a pair: 4-5 min on 2 cores at load ~13)
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
sys.path.insert(0, str(ROOT / "tests"))
from harness.dist import free_port  # noqa: E402

BIN = Path(sys.executable).parent
SPLIT = ("generate", "tools", "score", "reference", "train", "sync")


def env() -> dict:
    out = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    out["PATH"] = f"{BIN}{os.pathsep}{out.get('PATH', '')}"
    return out


def argv(kind: str, model: str, prompts: Path, out: Path, steps: int, ranks: int) -> list[str]:
    from helpers.tool_models import ENV_FILE

    sets = {"train.model": model, "train.dataset": prompts, "train.objective": "grpo", "train.steps": steps,
            "precision": "fp32", "batch.micro_batch_per_gpu": 32 // ranks, "batch.grad_accum_steps": 1,
            "batch.train_batch_size": '"auto"', "optimizer.type": "adamw", "optimizer.lr": 5e-3,
            "optimizer.weight_decay": 0, "scheduler.type": "none", "gradient_clipping": 1.0,
            "rl.num_generations": 8, "rl.max_completion_length": 160, "rl.max_prompt_length": 1024,
            "train.log_every": 1, "train.save_every": 0}
    if kind == "tools":
        sets.update({"rl.environment_factory": f"{ENV_FILE}:SecretEnv", "rl.max_tool_calling_iterations": 3})
    else:
        sets["rl.rewards"] = json.dumps(["harness.rl.toy:vowels"])
    args = ["--recipe", "zero2", "--output-dir", str(out), "--overwrite", "--profile-steps", ""]
    for key, value in sets.items():
        args += ["--set", f"{key}={value}"]
    return args


def run(kind: str, model: str, prompts: Path, out: Path, steps: int, ranks: int) -> dict:
    cmd = [str(BIN / "deepspeed"), "--master_port", str(free_port()), "--num_gpus", str(ranks), "harness/run.py",
           *argv(kind, model, prompts, out, steps, ranks)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=3600)
    if proc.returncode:
        raise SystemExit(f"{kind} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    train = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in train if r["kind"] == "train"][1:]  # the first step left out (warm-up)
    lines = [json.loads(x) for x in (out / "rollouts.jsonl").read_text().splitlines()]
    per_step = {}
    for r in lines:
        per_step.setdefault(r["step"], []).append(r)
    return {"steps": [_step(m, per_step[m["step"]]) for m in train if m["step"] in per_step],
            "split": {k: statistics.median(m.get(f"time/{k}_s", 0.0) for m in train) for k in SPLIT},
            "reward": [m["reward"] for m in train]}


def _step(metrics: dict, rows: list[dict]) -> dict:
    phase = metrics["time/generate_s"] + metrics.get("time/tools_s", 0.0)
    sampled = sum(sum(r["tool_mask"]) if "tool_mask" in r else len(r["completion_ids"]) for r in rows)
    everything = sum(len(r["prompt_ids"]) + len(r["completion_ids"]) for r in rows)
    return {"rows_s": len(rows) / phase, "sampled_tps": sampled / metrics["time/generate_s"],
            "all_tps": everything / phase, "tools_share": metrics.get("time/tools_s", 0.0) / phase,
            "turns": statistics.mean(len(r.get("turns") or [0]) for r in rows),
            "prompt": statistics.mean(len(r["prompt_ids"]) for r in rows), "sampled": sampled / len(rows),
            "tool_tokens": sum(len(r["completion_ids"]) - sum(r.get("tool_mask", [])) for r in rows
                               if "tool_mask" in r) / len(rows), "calls": metrics.get("tools/call_frequency", 0.0)}


def summary(kind: str, got: dict) -> str:
    med = {k: statistics.median(s[k] for s in got["steps"]) for k in got["steps"][0]}
    return (f"{kind:>6}: {med['rows_s']:.2f} rollouts/s, {med['sampled_tps']:.0f} sampled tok/s (generation), "
            f"{med['all_tps']:.0f} tok/s (rollout phase, prompts and tool tokens in), {med['turns']:.2f} generate "
            f"calls and {med['calls']:.2f} tool calls per rollout, {med['prompt']:.0f} prompt + {med['sampled']:.1f} "
            f"sampled + {med['tool_tokens']:.1f} tool tokens per rollout; rollout phase: generate "
            f"{1 - med['tools_share']:.0%}, tools {med['tools_share']:.0%}; step split (median): " + ", ".join(
                f"{k} {v * 1000:.0f} ms" for k, v in got["split"].items() if v))


def main() -> int:
    from helpers.tool_models import tool_model_folder, write_prompts

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--pairs", type=int, default=1, help="tools then single, then single then tools, ...")
    parser.add_argument("--ranks", type=int, default=1)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench_rl_tools_"))
    model, prompts = tool_model_folder(root / "model"), write_prompts(root / "prompts.jsonl", 64)
    results = {"tools": [], "single": []}
    for pair in range(args.pairs):
        for kind in (("tools", "single") if pair % 2 == 0 else ("single", "tools")):
            results[kind].append(run(kind, model, prompts, root / f"{kind}{pair}", args.steps, args.ranks))
            print(f"pair {pair}: {summary(kind, results[kind][-1])}", flush=True)
    ratio = [statistics.median(s["rows_s"] for s in t["steps"]) / statistics.median(s["rows_s"] for s in o["steps"])
             for t, o in zip(results["tools"], results["single"])]
    print(f"tool-use / single-turn rollouts/s: {', '.join(f'{r:.2f}' for r in ratio)} ({args.ranks} rank(s), "
          f"ZeRO-2, {args.steps - 1} steps each after the first); outputs under {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
