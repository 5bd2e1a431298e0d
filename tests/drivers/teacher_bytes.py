"""A distillation run's frozen teacher engine against the planner's teacher bytes: `measure(OUT, *HARNESS_RUN_ARGS)`,
a case of the distillation tests' shared 2-rank launch (tests/helpers/distill_launch.py, tests/drivers/jobs.py), or
deepspeed --num_gpus 2 tests/drivers/teacher_bytes.py OUT.json HARNESS_RUN_ARGS...

Resolves the run as harness/run.py does (session.prepare: the recipe, its checks, the DeepSpeed dict) and builds the
teacher as the run's engine mode does (harness/train/reference_engine.build_engine: distill.teacher_model_name_or_path
by the student's own build path, no optimizer, the student's ZeRO-3 keys), then counts the parameter bytes each rank
holds (tests/drivers/reference_bytes.held_bytes: ZeRO-3's partitions plus its persistent tensors whole), runs one
no_grad forward and counts what stays gathered, then two more (DeepSpeed's trace complete: its prefetch on) and the
most gathered at once before any module's forward, beside the largest decoder layer's bytes. Rank r writes OUT.json.rank{r}; the test sets them beside
`harness plan --objective gkd --teacher ...`.
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, os.path.dirname(HERE))

from harness.dist import exit_now  # noqa: E402
from harness.startup import quick_start  # noqa: E402


def main(out: str, argv: list[str]) -> int:
    from harness import dist as distmod

    distmod.init(10)
    try:
        return measure(out, *argv)
    finally:
        distmod.teardown()


def measure(out: str, *argv: str) -> int:
    """In a process group already up: build the teacher, count, write OUT.rank{r}."""
    import torch

    from harness import dist as distmod
    from harness.train import run_args, session
    from harness.train.reference_engine import build_engine
    from drivers.reference_bytes import held_bytes

    spec = session.prepare(run_args.parse(list(argv)), distmod.launched())
    rank = torch.distributed.get_rank()
    engine, info = build_engine(spec)
    before = held_bytes(engine.module)
    with torch.no_grad():
        engine(input_ids=torch.randint(0, 100, (2, 16)), use_cache=False)
    after = held_bytes(engine.module)
    peak = [0]

    def gathered(module, args):
        peak[0] = max(peak[0], held_bytes(engine.module)["gathered"])

    hooks = [m.register_forward_pre_hook(gathered) for m in engine.module.modules()]
    with torch.no_grad():
        for _ in range(2):
            engine(input_ids=torch.randint(0, 100, (2, 16)), use_cache=False)
    for hook in hooks:
        hook.remove()
    layer = max(sum(p.ds_numel * p.element_size() for p in block.parameters())
                for block in engine.module.model.layers)
    zero = spec.ds_config["zero_optimization"]
    result = {"held": before, "after_forward": after, "peak_gathered": peak[0], "layer_bytes": layer,
              "params": info.num_params,
              "stage": zero["stage"], "threshold": zero.get("stage3_param_persistence_threshold")}
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    quick_start()  # harness/run.py's start-up, before DeepSpeed is imported
    out_path, *run_argv = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    exit_now(main(out_path, run_argv))
