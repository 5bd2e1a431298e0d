"""The planner's engine-mode reference bytes per rank against a live frozen DeepSpeed engine:
deepspeed --num_gpus 2 tests/drivers/reference_bytes.py OUT.json

Each rank builds the tiny-llama preset (fp32, seeded random weights), freezes it and hands it to deepspeed.initialize
with NO optimizer block, as a preference run's reference engine is built (harness/train/reference_engine.py): ZeRO-3
(built under zero.Init, a small persistence threshold so some tensors stay whole) and stage 0 (a whole copy). It
counts the parameter bytes the rank holds (ZeRO-3: every partition, ds_tensor, plus the persistent tensors kept whole;
stage 0: every tensor), runs one no_grad forward and counts what ZeRO-3 still holds gathered after it. Beside them,
what the planner predicts from the config dict alone (planner/reference.engine_bytes). The test compares them.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from harness.dist import exit_now  # noqa: E402
from harness.startup import quick_start  # noqa: E402

THRESHOLD = 256  # elements: the norms (64) stay whole, every matrix is partitioned
FP32 = 4


def config(stage: int) -> dict:
    zero = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = THRESHOLD
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "zero_optimization": zero}


def held_bytes(module) -> dict:
    """Parameter bytes this rank holds: partitions and whole persistent tensors (ZeRO-3), or every tensor."""
    partitioned = whole = gathered = 0
    for p in module.parameters():
        if hasattr(p, "ds_tensor"):
            partitioned += p.ds_tensor.numel() * p.ds_tensor.element_size()
            if p.ds_persist:
                whole += p.ds_numel * p.ds_tensor.element_size()
            elif p.data.numel():  # gathered and not released
                gathered += p.data.numel() * p.element_size()
        else:
            whole += p.numel() * p.element_size()
    return {"partitioned": partitioned, "whole": whole, "gathered": gathered}


def case(stage: int, world: int) -> dict:
    import deepspeed
    import torch

    from harness.model.hf import build_model, load_model_config
    from harness.planner import reference
    from harness.planner.params import count_params

    ds = config(stage)
    model = build_model("tiny-llama", seed=0, zero3_init_config=ds if stage == 3 else None).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    engine = deepspeed.initialize(model=model, config=ds)[0]
    before = held_bytes(engine.module)
    with torch.no_grad():
        engine(input_ids=torch.randint(0, 100, (4, 16)), use_cache=False)
    after = held_bytes(engine.module)
    count = count_params(load_model_config("tiny-llama").to_dict())
    planned = reference.engine_bytes(count.total, stage=stage, offload_param="none", zero_shards=world,
                                     precision="fp32", persistent=count.persistent_numel(THRESHOLD) if stage == 3 else 0)
    return {"held": before, "after_forward": after, "planned": planned, "params": count.total}


def main(out: str) -> int:
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {f"zero{stage}": case(stage, world) for stage in (3, 0)}
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    quick_start()  # harness/run.py's start-up, before DeepSpeed is imported
    exit_now(main(next(a for a in sys.argv[1:] if not a.startswith("--local_rank"))))
