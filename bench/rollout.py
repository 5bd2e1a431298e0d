"""The harness's HF generator (harness/rl/generation/hf.py, what on-policy distillation and GRPO use) against
DeepSpeed 0.19.8's `deepspeed.runtime.rollout.HybridEngineRollout` on the same engine, prompts and sampling
settings, side by side in one run:

    harness launch --num_gpus 2 bench/rollout.py            (2 CPU ranks, ZeRO-3: the collective case)
    python bench/rollout.py --zero 0                        (one process, whole weights)

A random Llama (hidden 256, 4 layers, the shipped 512-token tokenizer) in a DeepSpeed engine with no optimizer;
each rank generates --batch completions of --max-new tokens at temperature 0.9 from prompts of 8-24 tokens, --repeats
times per generator, alternating. Rank 0 prints the median seconds per call, generated tokens per second, and
whether each generator gives a row the same completion when the batch around it changes (the harness draws each row
from its own seeded stream; the hybrid engine's sampling is HF generate's, one global RNG over the batch). The
numbers go to /tmp/rollout_bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def build(zero: int):
    import deepspeed
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from harness.model.hf import _shipped_eos_id, load_tokenizer

    eos = _shipped_eos_id()
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, num_hidden_layers=4, intermediate_size=704,
                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512,
                      bos_token_id=eos, eos_token_id=eos)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": zero,
              **({"stage3_param_persistence_threshold": 0} if zero == 3 else {})}}
    engine = deepspeed.initialize(model=model, config=config)[0]
    return engine, load_tokenizer("tiny-llama")


def prompts(batch: int, offset: int) -> list[list[int]]:
    import random

    rng = random.Random(offset)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(8, 24))] for _ in range(batch)]


def harness_call(engine, tokenizer, args, rank: int):
    from harness.rl.generation.hf import HFGenerator

    rl = {"generator": "hf", "max_completion_length": args.max_new, "temperature": 0.9, "top_k": 0, "top_p": 1.0}
    gen = HFGenerator(rl, engine, tokenizer, bound_bytes=None)

    def call(rows: list[list[int]], first_row: int) -> list[list[int]]:
        return gen.generate(rows, seed=1, first_row=first_row)
    return call


def deepspeed_call(engine, tokenizer, args, rank: int):
    import torch
    from deepspeed.runtime.rollout import HybridEngineRollout, RolloutRequest, SamplingConfig

    from harness.rl.generation.hf import left_pad

    rollout = HybridEngineRollout(engine, tokenizer)
    sampling = SamplingConfig(max_new_tokens=args.max_new, temperature=0.9, top_k=0, top_p=1.0)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def call(rows: list[list[int]], first_row: int) -> list[list[int]]:
        torch.manual_seed(1)  # its sampling draws from torch's global generator
        ids, mask = left_pad(rows, pad, engine.device)
        out = rollout.generate(RolloutRequest(ids, mask), sampling)
        start = ids.shape[1]
        return [[t for t, m in zip(row[start:].tolist(), att[start:].tolist()) if m] for row, att in
                zip(out.input_ids, out.attention_mask)]
    return call


def measure(call, rows, first_row: int) -> tuple[float, int]:
    began = time.perf_counter()
    out = call(rows, first_row)
    return time.perf_counter() - began, sum(map(len, out))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--zero", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-new", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args, _ = parser.parse_known_args()  # --local_rank from the launcher
    import deepspeed
    import torch.distributed as dist

    if "RANK" not in os.environ:  # one plain process: a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    engine, tokenizer = build(args.zero)
    rows = prompts(args.batch, rank)
    calls = {"harness HFGenerator": harness_call(engine, tokenizer, args, rank),
             "deepspeed HybridEngineRollout": deepspeed_call(engine, tokenizer, args, rank)}
    times = {name: [] for name in calls}
    tokens = {name: [] for name in calls}
    for name, call in calls.items():  # a warm-up call each
        measure(call, rows, rank * args.batch)
    for _ in range(args.repeats):
        for name, call in calls.items():
            seconds, made = measure(call, rows, rank * args.batch)
            times[name].append(seconds)
            tokens[name].append(made)
    same = {}  # row 1's completion alone (ranks call together: every rank its own row 1) against within the batch
    for name, call in calls.items():
        whole = call(rows, rank * args.batch)
        alone = call(rows[1:2], rank * args.batch + 1)
        same[name] = whole[1] == alone[0]
    result = {"world": world, "zero": args.zero, "batch_per_rank": args.batch, "max_new_tokens": args.max_new,
              "generators": {name: {"median_call_s": round(statistics.median(times[name]), 4),
                                    "tokens_per_call_per_rank": statistics.median(tokens[name]),
                                    "tokens_per_s_per_rank": round(statistics.median(
                                        t / s for t, s in zip(tokens[name], times[name])), 1),
                                    "row_independent_of_batch": same[name]} for name in calls}}
    if rank == 0:
        print(json.dumps(result, indent=1))
        Path("/tmp/rollout_bench.json").write_text(json.dumps(result, indent=1))
    dist.barrier()
    return 0


if __name__ == "__main__":
    from harness.dist import exit_now

    exit_now(main())
