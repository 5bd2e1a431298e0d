"""GPU check, GRPO generation with a colocated vLLM (bench/gpu_check.sh case grpo_vllm):

    python -m deepspeed.launcher.runner --num_gpus N bench/gpu_check_rl.py --out OUT

A ~0.5B Qwen2-shaped folder (random bf16 weights, the shipped tokenizer) as a ZeRO-3 policy engine on N GPUs; the
vllm generator (harness/rl/generation/vllm.py) wakes, syncs the weights in rl.sync_bucket_mb buckets of gathered
bytes, generates, sleeps; then one optimizer step and a second generation (the sync after the step). Measured per
rank: sync seconds, bytes and buckets and the largest bucket, the GPU memory the sync adds (max_memory_allocated
over its start) against planner/rl.py's sync_plan (peak = one bucket), vLLM's memory while awake against its
share, generate seconds, and the share of greedy tokens equal to the hf generator's (bf16: kernels differ, so
greedy paths may part after some tokens). Writes OUT/summary.json. Without vllm installed it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BUCKET_MB, PROMPTS, PROMPT_LEN, COMPLETION = 64, 16, 64, 128


def folder(out: Path) -> str:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from harness.model.hf import _shipped_eos_id, load_tokenizer

    path = out / "model"
    if not (path / "config.json").is_file():
        eos = _shipped_eos_id()
        cfg = Qwen2Config(vocab_size=512, hidden_size=1024, intermediate_size=2816, num_hidden_layers=24,
                          num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=4096,
                          bos_token_id=eos, eos_token_id=eos, tie_word_embeddings=True)
        torch.manual_seed(0)
        Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
        load_tokenizer("tiny-llama").save_pretrained(path)
    return str(path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from harness.rl.generation.vllm import unavailable

    why = unavailable()
    if why:
        print(f"[grpo_vllm] skipped: {why}")
        return 0
    import deepspeed
    import torch

    from harness.model.hf import build_model, load_tokenizer
    from harness.planner import rl as plan
    from harness.rl.generation.hf import HFGenerator
    from harness.rl.generation.vllm import VLLMGenerator

    deepspeed.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if rank == 0:
        folder(out)
    torch.distributed.barrier()
    path = str(out / "model")
    ds = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    model = build_model(path, seed=0, dtype="bfloat16", zero3_init_config=ds)
    engine = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)[0]
    tok = load_tokenizer(path)
    rl = {"max_completion_length": COMPLETION, "max_prompt_length": PROMPT_LEN, "top_k": 1,
          "sync_bucket_mb": BUCKET_MB, "vllm_gpu_memory_utilization": 0.3}
    gen = VLLMGenerator(rl, engine, tok, seed=0, root=out / "vllm")
    prompts = [[(7 * i + 13 * j) % 500 + 4 for j in range(PROMPT_LEN)] for i in range(PROMPTS)]
    rows = []
    for phase in ("start", "after_step"):
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        began = time.perf_counter()
        got = gen.generate(prompts, seed=1)
        rows.append({"phase": phase, "generate_s": time.perf_counter() - began, "sync": gen.last_sync,
                     "peak_over_start_bytes": torch.cuda.max_memory_allocated() - base})
        if phase == "start":
            loss = engine(input_ids=torch.tensor(prompts[:1], device=engine.device),
                          labels=torch.tensor(prompts[:1], device=engine.device)).loss
            engine.backward(loss)
            engine.step()
            gen.after_step()
    # a multi-turn turn (harness/rl/multiturn.py): rows by their global ids, vLLM's log-prob of each sampled token
    turn = gen.generate(prompts[:4], seed=2, row_ids=[10, 11, 12, 13], max_new=16)
    logps_ok = [len(lp) == len(ids) for lp, ids in zip(gen.last_logps, turn)]
    alone = gen.generate(prompts[1:2], seed=2, row_ids=[11], max_new=16)
    hf = HFGenerator(rl, engine, tok, bound_bytes=None).generate(prompts, seed=1)
    same = sum(a == b for x, y in zip(got, hf) for a, b in zip(x, y)) / max(1, sum(map(len, hf)))
    total = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
    predicted = plan.sync_plan(total_params=total, lp=2, bucket_mb=BUCKET_MB, world=world, link_gbps=400,
                               hbm_gbps=4000)
    summary = {"rank": rank, "world": world, "params": total, "runs": rows, "greedy_token_agreement": same,
               "multi_turn": {"logps_per_token": all(logps_ok), "row_stream_independent": alone[0] == turn[1]},
               "planner_sync": predicted}
    (out / f"summary_rank{rank}.json").write_text(json.dumps(summary, indent=1))
    if rank == 0:
        last = rows[-1]["sync"]
        print(f"[grpo_vllm] sync {last['bytes'] / 2**20:.0f} MiB in {last['buckets']} buckets (planner "
              f"{predicted['bytes'] / 2**20:.0f} MiB in {predicted['buckets']}), {last['seconds']:.3f} s; largest "
              f"bucket {last['peak_bucket_bytes'] / 2**20:.0f} MiB (bound {BUCKET_MB} MiB); generate "
              f"{rows[-1]['generate_s']:.2f} s; greedy agreement with hf {same:.2f}")
    return 0


if __name__ == "__main__":
    code = main()
    from harness.dist import exit_now

    exit_now(code)
