"""The baseline of bench/preference.py: a plain DPO loop on deepspeed.initialize, training what a harness DPO run
trained (engine mode: the reference as a second, frozen engine).

    deepspeed --num_gpus 2 bench/raw_dpo.py --run-dir RUN --pairs FILE [--steps 20] [--warmup-steps 3]

Reads RUN/recipe.json and RUN/ds_config.json (what the harness run wrote), builds the policy and the reference with
harness.model.hf.build_model (the same weights), tokenizes the pairs itself as TRL does (prompt tokens, then the
completion's and EOS; labels -100 on the prompt), cut to seq_len from the completion's end. bench/preference.py writes
pairs longer than seq_len, so every row is exactly seq_len tokens on both sides and padding plays no part. The loss
is TRL's sigmoid DPO on summed completion log-probs: -log sigmoid(beta x ((pi_c - ref_c) - (pi_r - ref_r))). The
reference engine has no optimizer block and shares the policy's ZeRO-3 parameter sharding (stage 0 otherwise).
Prints one JSON line on rank 0: tokens/s over the steps after the warm-up (2 x seq_len tokens per pair).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def rows(tokenizer, pairs_file: Path, seq_len: int):
    """[pairs, 2, seq_len] input ids and labels (chosen, rejected), TRL's joining: prompt + completion + EOS."""
    import torch

    ids, labels = [], []
    for line in pairs_file.read_text().splitlines():
        rec = json.loads(line)
        prompt = tokenizer(rec["prompt"], add_special_tokens=True)["input_ids"]
        pair_ids, pair_labels = [], []
        for side in ("chosen", "rejected"):
            completion = tokenizer(rec[side], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            row = (prompt + completion)[:seq_len]
            pair_ids.append(row)
            pair_labels.append(([-100] * len(prompt) + completion)[:seq_len])
        if min(len(r) for r in pair_ids) == seq_len:  # only full rows: no padding on either side
            ids.append(pair_ids)
            labels.append(pair_labels)
    return torch.tensor(ids), torch.tensor(labels)


def logps(engine, input_ids, labels):
    """Summed log-probs of the label tokens per row (the token at t predicted by the logits at t - 1)."""
    import torch

    logits = engine(input_ids=input_ids, use_cache=False).logits[:, :-1].float()
    target = labels[:, 1:]
    mask = target != -100
    per_token = torch.gather(logits.log_softmax(-1), 2, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (per_token * mask).sum(-1)


def reference_engine(train: dict, ds: dict):
    """The frozen reference: no optimizer block; the policy's ZeRO-3 parameter sharding, else stage 0."""
    import deepspeed

    from harness.model.hf import build_model

    zero = ds.get("zero_optimization", {})
    zero3 = zero.get("stage", 0) == 3
    ref_zero = {k: v for k, v in zero.items() if k.startswith("stage3_") or k in ("stage", "offload_param")}
    ref_ds = {"train_micro_batch_size_per_gpu": ds["train_micro_batch_size_per_gpu"],
              "gradient_accumulation_steps": 1, "zero_optimization": ref_zero if zero3 else {"stage": 0},
              **{k: {"enabled": True} for k in ("bf16", "fp16") if ds.get(k, {}).get("enabled")}}
    model = build_model(train["model"], seed=train["seed"], zero3_init_config=ref_ds if zero3 else None).eval()
    for param in model.parameters():
        param.requires_grad_(False)
    return deepspeed.initialize(model=model, config=ref_ds)[0]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True, type=Path)
    p.add_argument("--pairs", required=True, type=Path)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--local_rank", type=int, default=0)
    args = p.parse_args()

    import deepspeed
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from harness.dist import unlink_shm_buffer
    from harness.model.hf import build_model, load_tokenizer

    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    unlink_shm_buffer(dist)
    recipe = json.loads((args.run_dir / "recipe.json").read_text())
    ds = json.loads((args.run_dir / "ds_config.json").read_text())
    ds.pop("comms_logger", None)
    ds["wall_clock_breakdown"] = False
    train, beta = recipe["train"], recipe["preference"]["beta"]
    zero3 = ds.get("zero_optimization", {}).get("stage", 0) == 3
    policy = build_model(train["model"], seed=train["seed"], zero3_init_config=ds if zero3 else None,
                         gradient_checkpointing=recipe["activation_checkpointing"])
    engine, *_ = deepspeed.initialize(model=policy, model_parameters=list(policy.parameters()), config=ds)
    engine.train()
    reference = reference_engine(train, ds)

    ids, labels = rows(load_tokenizer(train["model"]), args.pairs, train["seq_len"])
    micro, gas = ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]
    per_step = micro * gas * world
    losses, ends, start = [], [], time.perf_counter()
    for step in range(args.steps):
        step_losses = []
        for k in range(gas):
            first = (step * per_step + (k * world + rank) * micro) % (len(ids) - micro + 1)
            batch = slice(first, first + micro)
            x = torch.cat([ids[batch, 0], ids[batch, 1]]).to(engine.device)  # chosen rows, then rejected
            y = torch.cat([labels[batch, 0], labels[batch, 1]]).to(engine.device)
            with torch.no_grad():
                ref_c, ref_r = logps(reference, x, y).chunk(2)
            pol_c, pol_r = logps(engine, x, y).chunk(2)
            loss = -F.logsigmoid(beta * ((pol_c - ref_c) - (pol_r - ref_r))).mean()
            engine.backward(loss)
            engine.step()
            step_losses.append(loss.detach())
        losses.append(torch.stack(step_losses).float().mean())
        ends.append(time.perf_counter())
    timed = ends[-1] - ends[args.warmup_steps - 1]
    tokens = per_step * 2 * train["seq_len"] * (args.steps - args.warmup_steps)
    mean = torch.stack(losses).double()
    dist.all_reduce(mean)
    if rank == 0:
        print(json.dumps({"raw": True, "tokens_per_s": tokens / timed, "pairs": len(ids),
                          "loss": (mean / world).tolist()}), flush=True)
    dist.destroy_process_group()
    from harness.dist import exit_now

    exit_now(0)  # as harness/run.py ends: no interpreter finalization after gloo (it can abort a finished rank)


if __name__ == "__main__":
    main()
