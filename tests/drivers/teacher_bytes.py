"""A distillation run's frozen teacher engine against the planner's teacher bytes:
deepspeed --num_gpus 2 tests/drivers/teacher_bytes.py OUT.json HARNESS_RUN_ARGS...

Resolves the run as harness/run.py does (session.prepare: the recipe, its checks, the DeepSpeed dict) and builds the
teacher as the run's engine mode does (harness/train/reference_engine.build_engine: distill.teacher_model_name_or_path
by the student's own build path, no optimizer, the student's ZeRO-3 keys), then counts the parameter bytes each rank
holds (tests/drivers/reference_bytes.held_bytes: ZeRO-3's partitions plus its persistent tensors whole), runs three
no_grad forwards and counts what stays gathered after them, and DURING each the most bytes gathered at once, whether
available or still in flight (sampled as each submodule's forward starts, after ZeRO's own pre-forward hook fetched
its parameters and launched the prefetch beyond them; the first forward has no trace, the second records it, the
third prefetches along it), with the number of parameters in flight at that peak. Rank r writes OUT.json.rank{r};
the test sets them beside `harness plan --objective gkd --teacher ...`.
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, HERE)

from harness.dist import exit_now  # noqa: E402
from harness.startup import quick_start  # noqa: E402


def main(out: str, argv: list[str]) -> int:
    import torch

    from harness import dist as distmod
    from harness.train import run_args, session
    from harness.train.reference_engine import build_engine
    from reference_bytes import held_bytes

    spec = session.prepare(run_args.parse(argv), distmod.launched())
    dist = distmod.init(10)
    engine, info = build_engine(spec)
    before = held_bytes(engine.module)
    window, inflight = [0], [0]  # per forward: the most gathered bytes, the parameters in flight then

    def sample(*_):
        gathered = held_bytes(engine.module)["gathered"]
        if gathered > window[-1]:
            window[-1] = gathered
            inflight[-1] = sum(p.ds_status.name == "INFLIGHT" for p in engine.module.parameters())

    hooks = [m.register_forward_pre_hook(sample) for m in engine.module.modules()]
    with torch.no_grad():
        for _ in range(3):
            engine(input_ids=torch.randint(0, 100, (2, 16)), use_cache=False)
            window.append(0)
            inflight.append(0)
    for hook in hooks:
        hook.remove()
    zero = spec.ds_config["zero_optimization"]
    result = {"held": before, "after_forward": held_bytes(engine.module), "in_forward": window[:3],
              "inflight_at_peak": inflight[:3], "params": info.num_params,
              "stage": zero["stage"], "threshold": zero.get("stage3_param_persistence_threshold")}
    with open(f"{out}.rank{dist.rank}", "w") as f:
        json.dump(result, f)
    distmod.teardown()
    return 0


if __name__ == "__main__":
    quick_start()  # harness/run.py's start-up, before DeepSpeed is imported
    out_path, *run_argv = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    exit_now(main(out_path, run_argv))
