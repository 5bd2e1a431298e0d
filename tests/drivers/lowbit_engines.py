"""8-bit optimizer states and FP8 matmuls on live engines (2 ranks, one process group):
deepspeed --num_gpus 2 tests/drivers/lowbit_engines.py OUT.json

int8 (why optimizer.state_dtype int8 is refused): torchao's AdamW8bit is DeepSpeed's client optimizer under ZeRO-2
(bf16), on tests/drivers/optim_engines.py's tiny Llama, 2 steps, twice: with every parameter trained (139,584:
69,792 per rank, not a multiple of 256) and with the RMSNorm weights frozen (139,264: 69,632 per rank, 272
blocks of 256). Per rank: the flat partition the optimizer steps, each state's class and the bytes of its
tensors (an 8-bit state: 1 B codes per element, an fp32 scale per 256-element block, a 256-entry fp32 code map),
and the losses.
fp8 (train.fp8, harness/model/fp8.py's swap): the same tiny Llama on ZeRO-2 bf16 with DeepSpeed's AdamW, 3 steps,
with bf16 matmuls and with torchao's Float8Linear (emulated on the CPU): the losses, how many layers were swapped,
and (rank 0) the update of layer 0 and the head (after - before) for the test to compare.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness.dist import exit_now  # noqa: E402
from harness.startup import quick_start  # noqa: E402
from optim_engines import batch, model  # noqa: E402

DS = {"gradient_accumulation_steps": 1, "gradient_clipping": 0.0, "bf16": {"enabled": True},
      "zero_optimization": {"stage": 2, "reduce_bucket_size": 4096, "allgather_bucket_size": 4096},
      "zero_allow_untested_optimizer": True}


def tensor_bytes(state) -> int:
    if hasattr(state, "__tensor_flatten__"):  # torchao's OptimState8bit: codes, scale, qmap
        return sum(getattr(state, n).numel() * getattr(state, n).element_size() for n in state.__tensor_flatten__()[0])
    return state.numel() * state.element_size()


def steps(engine, ids, n: int) -> list[float]:
    losses = []
    for _ in range(n):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def run(rank: int, world: int, freeze_norms: bool) -> dict:
    import deepspeed
    import torch
    from torchao.optim import AdamW8bit

    net = model()
    for name, p in net.named_parameters():
        p.requires_grad_(not (freeze_norms and "norm" in name))
    trained = [p for p in net.parameters() if p.requires_grad]
    ids = batch().chunk(world)[rank]
    engine, opt, *_ = deepspeed.initialize(model=net, optimizer=AdamW8bit(trained, lr=1e-3),
                                           config={**DS, "train_micro_batch_size_per_gpu": ids.shape[0]})
    losses = steps(engine, ids, 2)
    parts = [{"numel": p.numel(), **{k: {"class": type(v).__name__, "bytes": tensor_bytes(v)}
                                     for k, v in st.items() if k != "step"}} for p, st in opt.optimizer.state.items()]
    engine.destroy()
    torch.distributed.barrier()
    return {"trained": sum(p.numel() for p in trained), "partitions": parts, "losses": losses}


def run_fp8(rank: int, world: int, swap: bool) -> dict:
    import deepspeed
    import torch

    from harness.model import fp8

    net = model()
    before = {k: v.detach().to(torch.bfloat16).float().clone() for k, v in net.state_dict().items()}
    note = fp8.convert(net, {"train": {"fp8": swap}})
    ids = batch().chunk(world)[rank]
    ds = {**DS, "train_micro_batch_size_per_gpu": ids.shape[0], "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, *_ = deepspeed.initialize(model=net, config=ds, model_parameters=net.parameters())
    losses = steps(engine, ids, 3)
    after = {k: v.detach().float() for k, v in engine.module.state_dict().items()}
    update = {k: (after[k] - before[k]).flatten().tolist() for k in before
              if rank == 0 and ("layers.0." in k or k == "lm_head.weight")}
    swapped = sorted(n for n, m in engine.module.named_modules() if type(m).__name__ == "Float8Linear")
    engine.destroy()
    torch.distributed.barrier()
    return {"losses": losses, "swapped": swapped, "note": note, "update": update}


def results(rank: int, world: int) -> dict:
    """Every case of this driver in the process group that is up (also optim_engines.py's part `lowbit`)."""
    return {"all": run(rank, world, False), "norms_frozen": run(rank, world, True),
            "bf16": run_fp8(rank, world, False), "fp8": run_fp8(rank, world, True)}


def main(out_path: str) -> int:
    import torch

    from harness import dist as distmod

    distmod.init(10)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    try:
        found = results(rank, world)
    finally:
        distmod.teardown()
    Path(f"{out_path}.rank{rank}").write_text(json.dumps(found))
    return 0


if __name__ == "__main__":
    quick_start()
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    exit_now(main(args[0]))
