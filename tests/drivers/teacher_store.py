"""The precomputed teacher store written by 2 ranks through a ZeRO-3 teacher engine:
deepspeed --num_gpus 2 tests/drivers/teacher_store.py TEACHER_DIR STORE_DIR NUM_ROWS K TEMPERATURE
(or `write` as a case of tests/drivers/jobs.py, in its process group: tests/helpers/distill_launch.py)

Each rank loads the tiny teacher from its folder, frozen, into a DeepSpeed engine with no optimizer at ZeRO-3 (its
weights partitioned across the ranks by initialize, every forward collective), and writes the store with
harness.distill.teacher_store (each rank its micro-batches, gathered to the node's first rank). Then it asks again
with a teacher that fails if called: the store must be read, not recomputed. Rank 0 prints `written NOW READ`.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from harness.dist import exit_now  # noqa: E402
from harness.startup import quick_start  # noqa: E402

MICRO = 2


def main(teacher_dir: str, store_dir: str, num_rows: int, k: int, temperature: float) -> int:
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed()
    write(teacher_dir, store_dir, num_rows, k, temperature)
    dist.destroy_process_group()
    return 0


def write(teacher_dir: str, store_dir: str, num_rows: int, k: int, temperature: float) -> int:
    """The store written by the ZeRO-3 teacher engine, then asked for again, in the existing process group."""
    import deepspeed
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from harness.distill.teacher_store import ensure_teacher_store, store_key, store_path
    from tests.helpers.distill_rows import batch_fn, local_teacher, rows

    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    model = AutoModelForCausalLM.from_pretrained(teacher_dir, torch_dtype=torch.float32)  # partitioned by initialize
    for p in model.parameters():
        p.requires_grad_(False)
    engine = deepspeed.initialize(model=model.eval(), config=config)[0]
    assert all(p.ds_tensor.numel() < p.ds_numel for p in engine.module.parameters()), "not sharded"
    ids, labels = rows(num_rows)
    key = store_key(teacher=teacher_dir, weights=["test"], data={"seq_len": ids.shape[1]}, k=k,
                    temperature=temperature, precision="fp32")
    path = store_path(store_dir, key)
    common = dict(num_rows=num_rows, batch=batch_fn(ids, labels), micro=MICRO, vocab_size=512)
    _, written = ensure_teacher_store(path, key, teacher=local_teacher(engine, k, temperature), **common)

    def must_not_run(*_):
        raise AssertionError("the teacher ran although the store was there")
    _, again = ensure_teacher_store(path, key, teacher=must_not_run, **common)
    if dist.get_rank() == 0:
        print(f"written {written} read {not again}", flush=True)
    engine.destroy()
    dist.barrier()
    return 0


if __name__ == "__main__":
    quick_start()  # harness/run.py's start-up, before DeepSpeed is imported
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    exit_now(main(args[0], args[1], int(args[2]), int(args[3]), float(args[4])))
