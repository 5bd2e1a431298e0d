"""The baseline of bench/overhead.py: a plain DeepSpeed loop training exactly what a harness run trained.

    deepspeed --num_gpus 2 bench/raw_deepspeed.py --run-dir RUN [--steps 30] [--warmup-steps 2]

Reads RUN/recipe.json and RUN/ds_config.json (what a harness run wrote), builds the same model and packed
rows with harness.model.hf / harness.data.corpus / harness.data.batches, calls deepspeed.initialize with that config
and runs forward / backward / step. No loss reduction, grad-norm read, logging or hooks per step: the
losses are averaged over ranks once, after timing, so they can be checked against the harness's.
Prints one JSON line on rank 0: tokens/s over the steps after the warm-up steps.

Under sequence parallelism (the run's ds_config has sequence_parallel_size > 1) it trains the way DeepSpeed's
Ulysses-for-HF tutorial (deepspeed.ai/tutorials/ulysses-alst-sequence-parallelism) and ArcticTraining do:
`UlyssesSPAttentionHF.register_with_transformers` returns the mpu for deepspeed.initialize, a torch DataLoader per
rank wrapped in `UlyssesSPDataLoaderAdapter` (it all-gathers one row per SP rank and hands each rank its slice,
with `shift_labels`), the model's own `loss_function` on the slice's logits, then the tutorial's loss: a
differentiable `torch.distributed.nn.functional.all_gather` of the per-rank losses and valid-token counts, weighted.
Its loss VALUE is the replica's token mean (equal to the harness's); its gradient is sp times the true one under
ZeRO-0/1/2 (the engine averages over dp = world / sp only, and every SP rank backpropagates the full total) and
exact under ZeRO-3 (docs/deepspeed-facts.md, "Sequence parallelism"). That scale does not change the work, so
tokens/s compare either way; the bench pairs it on ZeRO-3, where both are exact. The only harness code it uses is
in setup: the model, the rows, and the run's attention implementation (document_sdpa on CPU under SP, registered
by name so DeepSpeed wraps the same function the harness's run used); the training loop is DeepSpeed + torch only.
Each rank's DataLoader yields the rows the harness's replica trains in the same order (adapter step i runs the row
of SP rank i % sp).
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
    sp = ds_config.get("sequence_parallel_size", 1)
    if sp > 1:
        ulysses(args, model, rows, ds_config, recipe)
        return
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=ds_config)
    engine.train()  # from_pretrained returns the model in eval mode: no dropout, and NO activation recomputation
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

    report(args, losses, start, ends, plan.global_batch * rows.shape[1], ds_config)


def report(args, losses: list, start: float, ends: list[float], tokens_per_step: int, ds_config: dict) -> None:
    """After timing: the per-step losses averaged over ranks, one JSON line on rank 0."""
    import torch
    import torch.distributed as dist

    mean_losses = torch.stack(losses).double()
    dist.all_reduce(mean_losses)
    timed = ends[-1] - ends[args.warmup_steps - 1] if args.warmup_steps else ends[-1] - start
    num_timed = args.steps - args.warmup_steps
    step_s = [b - a for a, b in zip([start, *ends], ends)]
    if dist.get_rank() == 0:
        print(json.dumps({"raw": True, "steps_timed": num_timed, "timed_s": timed,
                          "tokens_per_s": tokens_per_step * num_timed / timed, "step_time_s": step_s,
                          "loss": (mean_losses / dist.get_world_size()).tolist(), "ds_config": ds_config}), flush=True)
    dist.destroy_process_group()


def ulysses(args, model, rows, ds_config: dict, recipe: dict) -> None:
    """DeepSpeed's Ulysses tutorial loop (module docstring): mpu, DataLoader adapter, all-gathered weighted loss."""
    import deepspeed
    import torch
    import torch.distributed as dist
    import torch.distributed.nn.functional as dist_nn
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
    from torch.utils.data import DataLoader

    from harness.data.batches import BatchPlan
    from harness.model.sequence.attention import apply, resolve

    train, rank, world = recipe["train"], dist.get_rank(), dist.get_world_size()
    sp = ds_config["sequence_parallel_size"]
    micro, gas = ds_config["train_micro_batch_size_per_gpu"], ds_config["gradient_accumulation_steps"]
    attention = resolve(train.get("attention", "auto"), sp, torch.cuda.is_available())
    apply(model, attention)  # the attention function the harness's run used (setup only)
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation=attention, sequence_parallel_size=sp,
        micro_batch_size=micro, seq_length_is_variable=True)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=ds_config,
                                      mpu=mpu)
    engine.train()  # as the tutorial's model.train(): activation checkpointing recomputes only in train mode
    sp_group, sp_rank = mpu.get_sequence_parallel_group(), mpu.get_sequence_parallel_rank()
    # the replica's micro-batches in the harness's order; SP rank r's loader yields numbers r, r + sp, ...
    plan = BatchPlan(num_rows=rows.shape[0], global_batch=micro * gas * (world // sp), micro_batch=micro,
                     grad_accum=gas, dp_rank=rank // sp, dp_size=world // sp, seed=train["seed"])
    mine = [idx for step in range(args.steps) for idx in plan.micro_batches(step)][sp_rank::sp]
    names = ("input_ids", "labels", "position_ids")
    if len(mine) * sp != args.steps * gas:
        raise SystemExit(f"--steps {args.steps} x accumulation {gas} micro-batches do not split over sp {sp}: the "
                         "adapter gathers one row per SP rank (use a multiple of sp)")
    items = [dict(zip(names, rows[idx].tensors())) for idx in mine]
    for item in items:  # the adapter needs position ids (concat packing has none: 0..S-1 per row)
        ids = item["input_ids"]
        item.setdefault("position_ids", torch.arange(ids.shape[1]).expand(ids.shape[0], -1).contiguous())
    loader = UlyssesSPDataLoaderAdapter(DataLoader(items, batch_size=None), sp_rank=sp_rank, sp_group=sp_group,
                                        sp_world_size=sp, device=engine.device)
    unwrapped = engine.module
    losses, ends, step_losses = [], [], []
    start = time.perf_counter()
    for number, batch in enumerate(loader):  # the tutorial's loop
        batch = {k: v.to(engine.device) for k, v in batch.items()}
        shift_labels = batch.pop("shift_labels")
        outputs = engine(**batch, use_cache=False)
        loss = unwrapped.loss_function(logits=outputs.logits, labels=None, shift_labels=shift_labels,
                                       vocab_size=unwrapped.config.vocab_size)
        losses_per_rank = dist_nn.all_gather(loss, group=sp_group)
        good_tokens = (shift_labels != -100).view(-1).sum()
        good_per_rank = dist_nn.all_gather(good_tokens, group=sp_group)
        total_loss = sum(losses_per_rank[r] * good_per_rank[r] for r in range(sp))
        loss = total_loss / max(sum(good_per_rank), 1)
        engine.backward(loss)
        engine.step()
        step_losses.append(loss.detach())
        if (number + 1) % gas == 0:
            losses.append(torch.stack(step_losses).float().mean())
            ends.append(time.perf_counter())
            step_losses = []
    report(args, losses, start, ends, plan.global_batch * rows.shape[1], ds_config)


if __name__ == "__main__":
    from harness.dist import exit_now

    main()
    exit_now(0)  # as harness/run.py ends: no interpreter finalization after gloo (it can abort a finished rank)
