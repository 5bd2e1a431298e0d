"""ZeRO-3 of a MoE folder with per-expert keys (as transformers 5.24 saves it): what each rank reads and its build peak.

    python bench/moe_load.py [--out /tmp/moe_load] [--layers 8] [--experts 32] [--hidden 512] [--moe-inter 256]
                             [--baseline-pythonpath /path/to/an/older/checkout]

Writes a Qwen3-MoE folder (fp32, per-expert keys, 200 MB shards; about 0.14B parameters with the defaults), then
trains it one step on 2 CPU ranks with the zero3 recipe. The harness fills the partitioned model module by module
(model/load/zero3.py), the per-expert keys read as the fused tensors (model/load/experts.py): rank 0 reads the
folder once (the run logs the bytes), the other ranks read nothing. transformers' from_pretrained under zero.Init
(the path MoE folders took before) reads every file's state dict on every rank. --baseline-pythonpath runs the
same launch with another checkout (e.g. one where MoE folders still go through from_pretrained) for the comparison.
Prints per rank: bytes read (the log's count; the whole folder per rank for from_pretrained) and the build phase's
private peak above the rank's baseline (summary.json startup). Not a test: a minute per launch on two cores.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def write_folder(path: Path, args) -> int:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from harness.model.hf import _shipped_eos_id, load_tokenizer

    config = Qwen3MoeConfig(vocab_size=32000, hidden_size=args.hidden, num_hidden_layers=args.layers,
                            num_attention_heads=8, num_key_value_heads=4, head_dim=args.hidden // 8,
                            intermediate_size=4 * args.hidden, moe_intermediate_size=args.moe_inter,
                            num_experts=args.experts, num_experts_per_tok=2, max_position_embeddings=512,
                            tie_word_embeddings=False)
    config.bos_token_id = config.eos_token_id = _shipped_eos_id()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path, max_shard_size="200MB")
    load_tokenizer("tiny-llama").save_pretrained(path)
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


def launch(folder: Path, out: Path, pythonpath: str) -> dict:
    env = {**os.environ, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    from harness.dist import free_port

    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--master_port", str(free_port()), "--num_gpus", "2",
           f"{pythonpath}/harness/run.py", "--recipe", "zero3", "--output-dir", str(out),
           "--set", f"train.model={folder}", "--set", "train.steps=1", "--set", "train.seq_len=64",
           "--set", "train.save_every=0", "--set", "train.eval_every=0", "--set", "batch.micro_batch_per_gpu=1",
           "--set", "batch.grad_accum_steps=1", "--set", "precision=fp32"]
    proc = subprocess.run(cmd, cwd=pythonpath, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    builds = [r["build"] for r in summary["startup"]["per_rank"]]
    line = next((x for x in proc.stdout.splitlines() if "load: ZeRO-3 filled module by module" in x), None)
    read = re.search(r"rank 0 read ([0-9.]+) MiB", line) if line else None
    return {"by_module": line is not None, "rank0_read_mib": float(read[1]) if read else None, "log": line,
            "build_peak_mib": [round((b["peak_rss_anon_bytes"] - b["rss_anon_before_bytes"]) / 2**20, 1)
                               for b in builds]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="/tmp/moe_load")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--moe-inter", type=int, default=256)
    parser.add_argument("--baseline-pythonpath", default=None)
    args = parser.parse_args()
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    folder = out / "folder"
    size = write_folder(folder, args)
    results = {"folder_mib": round(size / 2**20, 1)}
    try:
        for name, path in (("harness", str(ROOT)), ("baseline", args.baseline_pythonpath)):
            if path:
                results[name] = launch(folder, out / name, path)
                shutil.rmtree(out / name, ignore_errors=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(json.dumps(results, indent=2))
    for name in ("harness", "baseline"):
        if name in results:
            r = results[name]
            reads = ([r["rank0_read_mib"], 0.0] if r["by_module"] else [results["folder_mib"]] * 2)
            print(f"{name}: {'by module' if r['by_module'] else 'from_pretrained'}; read per rank {reads} MiB of "
                  f"{results['folder_mib']} MiB; build peak per rank {r['build_peak_mib']} MiB")


if __name__ == "__main__":
    main()
