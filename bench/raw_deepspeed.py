"""The baseline of bench/overhead.py: a plain DeepSpeed loop training exactly what a harness run trained.

    deepspeed --num_gpus 2 bench/raw_deepspeed.py --run-dir RUN [--steps 30] [--warmup-steps 2]

Reads RUN/recipe.json and RUN/ds_config.json (what a harness run wrote), builds the same model and packed
rows with harness.model.hf / harness.data.corpus / harness.data.batches, calls deepspeed.initialize with that config
and runs forward / backward / step. No loss reduction, grad-norm read, logging or hooks per step: the
losses are averaged over ranks once, after timing, so they can be checked against the harness's.
Prints one JSON line on rank 0: tokens/s over the steps after the warm-up steps.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True, type=Path)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--keep-profiling", action="store_true", help="keep comms_logger / wall_clock_breakdown")
    p.add_argument("--local_rank", type=int, default=0)
    args = p.parse_args()

    import deepspeed
    import torch
    import torch.distributed as dist

    from harness.data.batches import BatchPlan
    from harness.data.corpus import DataSpec
    from harness.data.rows import Rows, model_inputs, split_rows
    from harness.data.store import prepare
    from harness.dist import unlink_shm_buffer
    from harness.model.hf import build_model, load_tokenizer

    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    unlink_shm_buffer(dist)  # as harness/dist.py does: DeepSpeed leaks it otherwise
    recipe = json.loads((args.run_dir / "recipe.json").read_text())
    ds_config = json.loads((args.run_dir / "ds_config.json").read_text())
    if not args.keep_profiling:  # the keys the harness adds when profiling is on
        ds_config.pop("comms_logger", None)
        ds_config["wall_clock_breakdown"] = False
    train = recipe["train"]
    store, _ = prepare(DataSpec.from_train(train), load_tokenizer(train["model"]), train["seq_len"],
                       train["store_dir"] or None)  # the harness run before this one prepared it
    rows = split_rows(Rows.of(store, train["packing"]), train["eval_fraction"], train["seed"])[0]
    zero3 = ds_config.get("zero_optimization", {}).get("stage", 0) == 3
    model = build_model(train["model"], seed=train["seed"], zero3_init_config=ds_config if zero3 else None,
                        gradient_checkpointing=recipe["activation_checkpointing"])
    from harness.model.moe.wiring import prepare_model

    prepare_model(model, recipe, ds_config)  # a MoE model: the router's loss as the harness sets it, AutoEP's shim
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=ds_config)
    micro, gas = ds_config["train_micro_batch_size_per_gpu"], ds_config["gradient_accumulation_steps"]
    plan = BatchPlan(num_rows=rows.shape[0], global_batch=micro * gas * world, micro_batch=micro, grad_accum=gas,
                     dp_rank=rank, dp_size=world, seed=train["seed"])

    losses, ends = [], []
    start = time.perf_counter()
    for step in range(args.steps):
        step_losses = []
        for idx in plan.micro_batches(step):
            loss = engine(**model_inputs(rows[idx].tensors(), engine.device), use_cache=False).loss
            engine.backward(loss)
            engine.step()
            step_losses.append(loss.detach())
        losses.append(torch.stack(step_losses).float().mean())
        ends.append(time.perf_counter())

    mean_losses = torch.stack(losses).double()
    dist.all_reduce(mean_losses)
    timed = ends[-1] - ends[args.warmup_steps - 1] if args.warmup_steps else ends[-1] - start
    num_timed = args.steps - args.warmup_steps
    tokens_per_step = plan.global_batch * rows.shape[1]
    step_s = [b - a for a, b in zip([start, *ends], ends)]
    if rank == 0:
        print(json.dumps({"raw": True, "steps_timed": num_timed, "timed_s": timed,
                          "tokens_per_s": tokens_per_step * num_timed / timed, "step_time_s": step_s,
                          "loss": (mean_losses / world).tolist(), "ds_config": ds_config}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    from harness.dist import exit_now

    main()
    exit_now(0)  # as harness/run.py ends: no interpreter finalization after gloo (it can abort a finished rank)
