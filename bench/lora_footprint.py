"""LoRA vs full fine-tuning on a ~0.2B Llama-shaped model folder: optimizer state per rank and checkpoint size.

    python bench/lora_footprint.py [--ranks 2] [--r 8] [--recipe zero2] [--keep DIR]

Writes a model folder (hidden 1024, 12 layers, MLP 2816, vocab 32000, untied: 0.23B parameters, seeded random
weights, the shipped tokenizer), then trains it 2 steps twice on the same ranks, full and with
--set adapter.type=lora --set adapter.r=R, bf16, saving at the end. Reported per run, from the runs' own files:
the optimizer state per rank (fp32 master + Adam moments, as the profiling hook counted the live tensors on each
rank: summary.json memory.model_states_per_rank) and the checkpoint folder's bytes on disk. Goals (#15): LoRA's
optimizer state per rank < 2 % of full fine-tuning's, its checkpoint < 5 %. Peak memory ~4 GB (full, 2 ranks);
everything written goes under a temporary folder that is deleted at the end (unless --keep).
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
from harness.dist import free_port  # noqa: E402

OPTIMIZER_TERMS = ("fp32_master", "optimizer_moments")


def write_model(folder: Path, vocab: int = 32000, hidden: int = 1024, mlp: int = 2816, layers: int = 12,
                heads: int = 16) -> int:
    """A seeded random Llama folder with the shipped tokenizer (bench/optimizer_states.py sizes its own)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from harness.model.hf import _shipped_eos_id, load_tokenizer

    eos = _shipped_eos_id()
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=512,
                         tie_word_embeddings=False, bos_token_id=eos, eos_token_id=eos)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    load_tokenizer("tiny-llama").save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def train(run: Path, model: Path, ranks: int, recipe: str, extra: list[str]) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=str(ROOT))
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--master_port", str(free_port()), "--num_gpus", str(ranks),
           "harness/run.py", "--recipe", recipe, "--output-dir", str(run), "--set", f"train.model={model}",
           "--set", "train.steps=2", "--set", "train.seq_len=64", "--set", "batch.micro_batch_per_gpu=1",
           "--set", "train.eval_every=0", "--set", "train.eval_fraction=0.01", "--profile-steps", "1-2", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    summary = json.loads((run / "summary.json").read_text())
    per_rank = [sum(sum(states[t].values()) for t in OPTIMIZER_TERMS if t in states)
                for states in summary["memory"]["model_states_per_rank"]]
    ckpt = run / "checkpoints" / "global_step2"
    return {"optimizer_bytes_per_rank": max(per_rank),
            "checkpoint_bytes": sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--r", type=int, default=8)
    parser.add_argument("--recipe", default="zero2")
    parser.add_argument("--keep", help="keep the model and runs in this folder")
    args = parser.parse_args()
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="lora_footprint_"))
    try:
        params = write_model(work / "model")
        full = train(work / "full", work / "model", args.ranks, args.recipe, [])
        shutil.rmtree(work / "full" / "checkpoints")  # GBs: gone before the second run writes its own
        lora = train(work / "lora", work / "model", args.ranks, args.recipe,
                     ["--set", "adapter.type=lora", "--set", f"adapter.r={args.r}"])
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"model {params / 1e9:.3f}B params, {args.recipe} on {args.ranks} ranks, bf16, LoRA r={args.r}")
    print(f"{'':28}{'full':>16}{'lora':>16}{'lora / full':>14}  goal")
    for key, goal in (("optimizer_bytes_per_rank", 0.02), ("checkpoint_bytes", 0.05)):
        ratio = lora[key] / full[key]
        print(f"{key:28}{full[key]:>16,}{lora[key]:>16,}{ratio:>13.2%}  < {goal:.0%} {'ok' if ratio < goal else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
