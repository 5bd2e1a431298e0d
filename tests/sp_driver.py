"""Sequence-parallel parity in ONE process group: deepspeed --num_gpus 2 tests/sp_driver.py OUT.json MODEL.

Every engine is built in this process (SP patches transformers' attention table process-wide, so the sp=1
references are built and stepped first, with plain sdpa, then the sp=2 engines with the harness's document_sdpa
under DeepSpeed's Ulysses wrapper). Each engine takes ONE SGD step at lr 1 without clipping, so the update is the
gradient; rank 0 writes, per configuration, the logged loss, the grad norm and the flat update, and the per-token
losses of packed rows for the document-masking check. tests/test_sequence_parallel.py asserts on them.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness.dist import exit_now  # noqa: E402

SEQ, ROWS, SEED = 32, 4, 7
STAGES = [("zero0", {"stage": 0}), ("zero1", {"stage": 1}), ("zero2", {"stage": 2}), ("zero3", {"stage": 3}),
          ("zero3_offload", {"stage": 3, "offload_optimizer": {"device": "cpu"}})]


def ds_config(zero: dict, micro: int, gas: int, dp: int, sp: int) -> dict:
    return {"train_batch_size": micro * gas * dp, "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": gas, "gradient_clipping": 1e9, "zero_optimization": zero,
            "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False, "steps_per_print": 10 ** 9,
            **({"sequence_parallel_size": sp} if sp > 1 else {})}


def data(vocab: int):
    import torch

    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(3, vocab, (ROWS, SEQ), generator=g)
    return ids, ids.clone()


def flat_params(engine):
    import deepspeed
    import torch

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=hasattr(params[0], "ds_id")):
        return torch.cat([p.detach().float().reshape(-1).clone() for p in params])


def build(model_name: str, zero: dict, attention: str):
    from harness.model.hf import build_model
    from harness.model.sequence import attention as attn

    cfg = {"zero_optimization": zero, "train_micro_batch_size_per_gpu": 1}
    model = build_model(model_name, seed=SEED, zero3_init_config=cfg if zero["stage"] == 3 else None)
    attn.apply(model, attention)
    return model


def step(model, ds: dict, mpu, batches, loss_fn):
    """One optimizer step over the micro-batches; (mean logged loss, grad norm, update)."""
    import deepspeed
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds, mpu=mpu)
    before = flat_params(engine)
    logged = []
    for batch in batches:
        loss, log = loss_fn(engine, batch)
        engine.backward(loss)
        engine.step()
        logged.append(float(log))
    norm = engine.get_global_grad_norm()  # None on ZeRO-0 with a client optimizer
    norm = None if norm is None else float(norm)
    update = (before - flat_params(engine)).tolist()
    engine.destroy()
    return sum(logged) / len(logged), norm, update


def main(out_path: str, model_name: str) -> int:
    import torch

    from harness import dist as distmod
    from harness.model.sequence import loss as sploss, ulysses
    from harness.train.trainer import _loss

    dist = distmod.init(10)
    results = {}
    try:
        vocab = build(model_name, {"stage": 0}, "sdpa").config.vocab_size
        ids, labels = data(vocab)
        # sp=1, dp=2: rank r takes rows r and r+2 (micro 1, accumulation 2)
        for name, zero in STAGES:
            model = build(model_name, zero, "sdpa")
            rows = [(ids[i:i + 1], labels[i:i + 1]) for i in (dist.rank, dist.rank + 2)]
            loss, norm, update = step(model, ds_config(zero, 1, 2, 2, 1), None, rows,
                                      lambda e, b: (lambda l: (l, l.detach()))(_loss(e, b)))
            results[f"sp1/{name}"] = {"loss": distmod.mean_across_ranks([loss])[0], "norm": norm, "update": update}
        # sp=2, dp=1: both ranks hold rows (0, 2) then (1, 3) (micro 2, accumulation 2), each a half sequence
        for name, zero in STAGES:
            model = build(model_name, zero, "document_sdpa")
            mpu = ulysses.setup(model, "document_sdpa", 2, 2)
            sp_rank = ulysses.coords(dist.rank, dist.world_size, 2)[0]
            rows = [(ids[[0, 2]], labels[[0, 2]]), (ids[[1, 3]], labels[[1, 3]])]
            loss, norm, update = step(model, ds_config(zero, 2, 2, 1, 2), mpu, rows,
                                      lambda e, b: sploss.micro_loss(e, b, 2, sp_rank, zero["stage"], None))
            results[f"sp2/{name}"] = {"loss": distmod.mean_across_ranks([loss])[0], "norm": norm, "update": update}
    finally:
        if dist.rank == 0:
            with open(out_path, "w") as f:
                json.dump(results, f)
        distmod.teardown()
    return 0


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    exit_now(main(*args))
