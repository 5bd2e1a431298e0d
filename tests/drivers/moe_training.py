"""MoE jobs in ONE 2-rank process group:
deepspeed --num_gpus 2 tests/drivers/moe_training.py CASES.json RESULT.json.

CASES.json: {"jobs": [harness/run.py argument lists, run as tests/drivers/jobs.py runs them], "disjoint": argv or
null}. The disjoint case builds the engine the harness builds for argv (ZeRO-3 with the leaf table, the router's
loss on) and trains it on batches chosen per rank (tests/helpers/moe_models.disjoint_batches: rank 0 only token
ids that its router sends to experts {0, 1}, rank 1 ids sent to {2, 3}), counting the experts each rank's router
picked; rank 0 writes the mean losses, grad norms and each rank's experts per layer to RESULT.json.
"""

from __future__ import annotations

import json
import os
import sys

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(TESTS))  # the repository (harness)
sys.path.insert(0, TESTS)  # helpers

from harness.dist import exit_now  # noqa: E402
from harness.startup import quick_start  # noqa: E402


def disjoint(argv: list[str], dist, steps: int, micro: int, seq_len: int) -> dict:
    import torch
    import torch.distributed as tdist

    from harness import profiling
    from harness.dist import launched
    from harness.model.moe.routing import counter_for
    from harness.train import job, run_args, session
    from helpers.moe_models import disjoint_batches

    spec = session.prepare(run_args.parse(argv), launched())
    engine, *_ = job.build_engine(spec, profiling.Startup(dist.device))
    counter = counter_for(engine.module)
    losses, auxes, norms, experts = [], [], [], []
    for ids, labels in disjoint_batches(steps, micro, seq_len):
        mine = slice(dist.rank * micro, (dist.rank + 1) * micro)
        counter.reset()
        out = engine(input_ids=ids[mine], labels=labels[mine], use_cache=False)
        engine.backward(out.loss)
        engine.step()
        pair = torch.stack([out.loss.detach(), out.aux_loss.detach()]).double()
        tdist.all_reduce(pair)
        losses.append(pair[0].item() / dist.world_size)
        auxes.append(pair[1].item() / dist.world_size)
        norms.append(float(engine.get_global_grad_norm()))
        used = {layer: sorted(i for i, n in enumerate(c) if n) for layer, c in counter.table().items()}
        gathered = [None] * dist.world_size
        tdist.all_gather_object(gathered, used)
        experts.append(gathered)
    counter.close()
    job.quiesce(engine)
    return {"loss": losses, "aux_loss": auxes, "grad_norm": norms, "experts": experts}


def main(cases_path: str, result_path: str) -> int:
    from harness import dist as distmod
    from harness.train import job, run_args, session

    cases = json.loads(open(cases_path).read())
    dist = distmod.init(10)
    result = {}
    try:
        for argv in cases["jobs"]:
            code = job.run(session.prepare(run_args.parse(argv), distmod.launched()), dist)
            if code != 0:
                raise SystemExit(f"case {argv} exited {code}")
            distmod.barrier()
        if cases.get("disjoint"):
            result["disjoint"] = disjoint(cases["disjoint"], dist, **cases["disjoint_shape"])
        if dist.is_main:
            open(result_path, "w").write(json.dumps(result))
    finally:
        distmod.teardown()
    return 0


if __name__ == "__main__":
    quick_start()  # harness/run.py's start-up, before DeepSpeed is imported
    exit_now(main(*[a for a in sys.argv[1:] if not a.startswith("--local_rank")]))
