"""Frozen ZeRO-3 parameters after activation-checkpoint recompute (deepspeedai/DeepSpeed#8148; issue 41 item 4):
deepspeed --num_gpus 2 tests/drivers/frozen_zero3.py OUT.json HARNESS_RUN_ARGS...

Builds the run's engine as harness/run.py does (session.prepare, job.build_engine: LoRA attached, HF gradient
checkpointing on when the recipe asks), trains STEPS steps with the trainer's own step function, and records, per
rank, every frozen ZeRO-3 parameter that is still gathered after the step (ds_status not NOT_AVAILABLE, or a
non-empty .data), persistent ones (below stage3_param_persistence_threshold, whole by design) apart; and, as the
check's control, how many it saw gathered inside a forward (rank 0's, in gathered_in_forward).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from harness.dist import exit_now  # noqa: E402

STEPS = 2


def frozen_state(module) -> dict:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    frozen = [(n, p) for n, p in module.named_parameters() if not p.requires_grad and hasattr(p, "ds_status")]
    gathered = [n for n, p in frozen if not p.ds_persist and (p.ds_status != ZeroParamStatus.NOT_AVAILABLE
                                                              or p.data.numel() > 0)]
    return {"frozen": len(frozen), "persistent": sum(p.ds_persist for _, p in frozen), "gathered": gathered,
            "gathered_bytes": sum(p.ds_numel * p.element_size() for n, p in frozen if n in gathered)}


def watch_forward(module) -> list[int]:
    """The check's control: a forward pre-hook on the first module holding partitioned frozen weights, registered
    after ZeRO-3's own (which gathers them), records how many it sees gathered there; the test wants > 0, so the
    same check after the step would see a weight left gathered."""
    seen: list[int] = []
    for _, sub in module.named_modules():
        own = [p for p in sub.parameters(recurse=False) if not p.requires_grad and hasattr(p, "ds_status")
               and not p.ds_persist]
        if own:
            sub.register_forward_pre_hook(lambda m, args: seen.append(len(frozen_state(m)["gathered"])))
            return seen
    return seen


def main(out: str, argv: list[str]) -> int:
    from harness import dist as distmod, profiling
    from harness.model.hf import load_tokenizer
    from harness.train import job, run_args, session
    from harness.train.trainer import batch_plan, fetch, strategy

    spec = session.prepare(run_args.parse(argv), distmod.launched())
    dist = distmod.init(10)
    try:
        data = job.load_data(spec, dist, load_tokenizer(spec.recipe["train"]["model"]))
        engine, _, _ = job.build_engine(spec, profiling.Startup(dist.device))
        plan, step_fn = batch_plan(spec, dist, data), strategy(spec)[0]
        during = watch_forward(engine.module)
        states = []
        for step in range(STEPS):
            step_fn(engine, [fetch(data.train, rows) for rows in plan.micro_batches(step)])
            states.append(frozen_state(engine.module))
        every = [None] * dist.world_size
        import torch.distributed as td

        td.all_gather_object(every, states)
        if dist.is_main:
            with open(out, "w") as f:
                json.dump({"checkpointing": spec.recipe["activation_checkpointing"], "ranks": every,
                       "gathered_in_forward": during}, f)
        job.quiesce(engine)
    finally:
        distmod.teardown()
    return 0


if __name__ == "__main__":
    from harness.startup import quick_start

    quick_start()  # harness/run.py's start-up, before DeepSpeed is imported
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    exit_now(main(args[0], args[1:]))
