"""DPO through the harness: per-rank memory beside the planner for each reference mode, tokens/s of the modes side by
side, and the harness over a plain DPO loop on deepspeed.initialize (bench/raw_dpo.py).

    python bench/preference.py [--sizes tiny,small] [--ranks 2] [--recipe zero2] [--steps 20] [--warmup-steps 3]
                               [--pairs 96] [--keep DIR]

Per size: a Llama-shaped model folder (seeded random weights, the shipped tokenizer) and a preference jsonl of
random words whose prompt + completion is longer than seq_len, so every row is cut to exactly seq_len tokens (no
padding on either side). Then harness/run.py with train.objective=dpo and preference.reference_mode precomputed,
engine and adapter (adapter: adapter.type=lora on the same recipe), and bench/raw_dpo.py on the engine run's
resolved config. Reported per mode from the runs' own files: the peak per rank measured by the profiling hook
(GPU: max allocated; CPU ranks: RssAnon less malloc's free memory) beside the planner's prediction for that rank
(summary.json memory.predicted_peak_total_per_rank, which counts the engine mode's reference weights), and tokens/s
over the steps after the warm-up (2 x seq_len tokens per pair; the precomputed pass is before step 1 and not in
it). Goal: harness engine mode / plain loop >= 0.98. Everything goes under a temporary folder deleted at the end
(unless --keep). On CPU ranks the measured peak includes each process's own heap (Python, torch, the tokenizer:
hundreds of MB), so the memory ratio says something only where the model dominates, or on GPUs.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
from overhead import deepspeed, fail  # noqa: E402  the same launch and environment as bench/overhead.py

GOAL = 0.98
MODES = ("precomputed", "engine", "adapter")
SIZES = {  # name: (LlamaConfig fields, seq_len); untied, MHA
    "tiny": (dict(hidden_size=256, num_hidden_layers=4, intermediate_size=704, num_attention_heads=4), 128),
    "small": (dict(hidden_size=1024, num_hidden_layers=12, intermediate_size=2816, num_attention_heads=16), 256),
}
WORDS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa")


def write_model(folder: Path, size: str) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from harness.model.hf import _shipped_eos_id, load_tokenizer

    fields, seq = SIZES[size]
    eos = _shipped_eos_id()
    cfg = LlamaConfig(vocab_size=32000, num_key_value_heads=fields["num_attention_heads"],
                      max_position_embeddings=2 * seq, tie_word_embeddings=False, bos_token_id=eos, eos_token_id=eos,
                      **fields)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(folder)
    load_tokenizer("tiny-llama").save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def write_pairs(path: Path, pairs: int, seq_len: int) -> None:
    """Prompts of seq_len / 10 words (a word is 2-3 tokens), completions longer than seq_len: every row is cut to
    seq_len."""
    rng = random.Random(0)
    words = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))  # noqa: E731
    with path.open("w") as f:
        for _ in range(pairs):
            f.write(json.dumps({"prompt": words(seq_len // 10), "chosen": words(seq_len),
                                "rejected": words(seq_len)}) + "\n")


def run_harness(args, run: Path, model: Path, data: Path, seq_len: int, mode: str) -> dict:
    lora = ["--set", "adapter.type=lora"] if mode == "adapter" else []
    proc = deepspeed(args.ranks, "harness/run.py", "--recipe", args.recipe, "--output-dir", str(run),
                     "--set", f"train.model={model}", "--set", f"train.dataset={data}",
                     "--set", f"train.seq_len={seq_len}", "--set", f"train.steps={args.steps}",
                     "--set", "train.objective=dpo", "--set", f"preference.reference_mode={mode}",
                     "--set", "train.eval_every=0", "--set", "train.save_every=0", "--set", "train.log_every=1",
                     "--profile-steps", f"{args.steps - 1}-{args.steps}", *lora)
    if not (run / "summary.json").is_file():
        raise fail(proc)
    summary = json.loads((run / "summary.json").read_text())
    train = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]
    ds = json.loads((run / "ds_config.json").read_text())
    pairs_per_step = ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * args.ranks
    timed = train[-1]["time"] - train[args.warmup_steps - 1]["time"]
    mem = summary["memory"]
    peaks = [r.get("peak_allocated_bytes", r.get("peak_in_use_bytes")) for r in mem["peak_per_rank"]]
    return {"tokens_per_s": pairs_per_step * 2 * seq_len * (len(train) - args.warmup_steps) / timed,
            "measured": max(peaks), "predicted": max(mem["predicted_peak_total_per_rank"]),
            "loss": [r["loss"] for r in train]}


def run_raw(args, run: Path, data: Path) -> dict:
    proc = deepspeed(args.ranks, "bench/raw_dpo.py", "--run-dir", str(run), "--pairs", str(data),
                     "--steps", str(args.steps), "--warmup-steps", str(args.warmup_steps))
    lines = [line for line in proc.stdout.splitlines() if line.startswith('{"raw"')]
    if proc.returncode or not lines:
        raise fail(proc)
    return json.loads(lines[0])


def bench_size(args, work: Path, size: str) -> list[str]:
    seq_len = SIZES[size][1]
    folder = work / size
    params = write_model(folder / "model", size)
    write_pairs(folder / "pairs.jsonl", args.pairs, seq_len)
    runs = {m: run_harness(args, folder / m, folder / "model", folder / "pairs.jsonl", seq_len, m) for m in MODES}
    raw = run_raw(args, folder / "engine", folder / "pairs.jsonl")
    lines = [f"{size}: {params / 1e6:.1f}M params, seq {seq_len}, {args.recipe} on {args.ranks} ranks"]
    for mode, r in runs.items():
        lines.append(f"  {mode:<12}{r['measured'] / 2**20:>12.1f}{r['predicted'] / 2**20:>12.1f}"
                     f"{r['measured'] / r['predicted']:>10.2f}{r['tokens_per_s']:>12.0f}"
                     f"{r['tokens_per_s'] / runs['engine']['tokens_per_s']:>10.2f}")
    ratio = runs["engine"]["tokens_per_s"] / raw["tokens_per_s"]
    lines.append(f"  {'plain loop':<12}{'':>34}{raw['tokens_per_s']:>12.0f}      harness engine / plain "
                 f"{ratio:.3f} (goal >= {GOAL}: {'ok' if ratio >= GOAL else 'MISSED'})")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="tiny", help=f"comma-separated, of {', '.join(SIZES)}")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--recipe", default="zero2")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=96)
    parser.add_argument("--keep", help="keep the models and runs in this folder")
    args = parser.parse_args()
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="preference_bench_"))
    out = [f"  {'mode':<12}{'peak MiB':>12}{'planner MiB':>12}{'ratio':>10}{'tokens/s':>12}{'/ engine':>10}"]
    try:
        for size in args.sizes.split(","):
            out += bench_size(args, work, size.strip())
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
