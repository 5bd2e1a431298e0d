"""Sequence-parallel parity in ONE process group:
deepspeed --num_gpus 2 tests/drivers/sequence_parallel.py OUT.json MODEL.

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
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from harness.dist import exit_now  # noqa: E402
from harness.startup import quick_start  # noqa: E402

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


def packed_rows(vocab: int):
    """Two packed rows of documents (lengths below), position ids restarting per document, each document's
    first label -100; documents cross the SP shard boundary (position 16)."""
    import torch

    g = torch.Generator().manual_seed(SEED + 1)
    ids = torch.randint(3, vocab, (2, SEQ), generator=g)
    labels, positions = ids.clone(), torch.zeros_like(ids)
    for row, lengths in enumerate(DOCS):
        start = 0
        for length in lengths:
            positions[row, start:start + length] = torch.arange(length)
            labels[row, start] = -100
            start += length
    return ids, labels, positions


DOCS = [(5, 14, 13), (20, 12)]


def token_losses(logits, labels):
    import torch

    return torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), labels, ignore_index=-100,
                                             reduction="none")


@__import__("torch").no_grad()
def document_losses(model_name: str, rank: int) -> dict:
    """Per-token losses of packed rows at sp=2 (document_sdpa under Ulysses), of each document alone at sp=1
    (plain sdpa, same weights), and of the packed rows without restarting positions (attention across documents:
    the control that shows the comparison can fail)."""
    import torch
    import torch.distributed as tdist

    from harness.model.sequence import ulysses

    model = build(model_name, {"stage": 0}, "document_sdpa").eval()
    ulysses.setup(model, "document_sdpa", 2, 2)
    reference = build(model_name, {"stage": 0}, "sdpa").eval()
    ids, labels, positions = packed_rows(model.config.vocab_size)
    sp_rank = rank % 2  # SP groups are consecutive ranks (model/sequence/steps.py)
    part_ids, part_labels, part_pos = ulysses.shard((ids, labels, positions), sp_rank, 2)
    part = token_losses(model(input_ids=part_ids, position_ids=part_pos, use_cache=False).logits, part_labels)
    parts = [torch.empty_like(part) for _ in range(2)]
    tdist.all_gather(parts, part.contiguous())
    packed = torch.cat(parts, dim=1)
    alone, leaky = torch.zeros_like(packed), torch.zeros_like(packed)
    shifted = ulysses.shift_labels(labels)
    for row, lengths in enumerate(DOCS):
        start = 0
        for length in lengths:
            doc = ids[row:row + 1, start:start + length]
            out = reference(input_ids=doc, position_ids=torch.arange(length)[None], use_cache=False).logits
            alone[row, start:start + length] = token_losses(out, ulysses.shift_labels(doc))[0]
            start += length
        whole = reference(input_ids=ids[row:row + 1], use_cache=False).logits
        leaky[row] = token_losses(whole, shifted[row:row + 1])[0]
    return {"packed": packed.tolist(), "alone": alone.tolist(), "leaky": leaky.tolist(), "docs": DOCS}


def main(out_path: str, model_name: str, second_family: str) -> int:
    import torch

    from harness import dist as distmod
    from harness.model.sequence import loss as sploss, tiling, ulysses
    from harness.train.trainer import _forward

    dist = distmod.init(10)
    results = {}
    try:
        vocab = build(model_name, {"stage": 0}, "sdpa").config.vocab_size
        ids, labels = data(vocab)
        # sp=1, dp=2: rank r takes rows r and r+2 (micro 1, accumulation 2)
        for name, zero in STAGES[::3]:  # the sp=1 references: ZeRO-0 (the engine factor 1) and ZeRO-3 (sp)
            model = build(model_name, zero, "sdpa")
            rows = [(ids[i:i + 1], labels[i:i + 1]) for i in (dist.rank, dist.rank + 2)]
            loss, norm, update = step(model, ds_config(zero, 1, 2, 2, 1), None, rows,
                                      lambda e, b: (lambda l: (l, l.detach()))(_forward(e, b).loss))
            results[f"sp1/{name}"] = {"loss": distmod.mean_across_ranks([loss])[0], "norm": norm, "update": update}
        # sp=2, dp=1: both ranks hold rows (0, 2) then (1, 3) (micro 2, accumulation 2), each a half sequence
        for name, zero in STAGES:
            model = build(model_name, zero, "document_sdpa")
            mpu = ulysses.setup(model, "document_sdpa", 2, 2)
            sp_rank = dist.rank % 2  # SP groups are consecutive ranks (model/sequence/steps.py)
            rows = [(ids[[0, 2]], labels[[0, 2]]), (ids[[1, 3]], labels[[1, 3]])]
            loss, norm, update = step(model, ds_config(zero, 2, 2, 1, 2), mpu, rows,
                                      lambda e, b: sploss.micro_loss(e, b, 2, sp_rank, zero["stage"], None))
            results[f"sp2/{name}"] = {"loss": distmod.mean_across_ranks([loss])[0], "norm": norm, "update": update}
        # tiled loss + tiled MLP on ZeRO-3, the loss rescaled by 1/7 after the tiled head (and 1/2 by the
        # accumulation): 7 x the update must be the untiled one
        try:  # an error here (the same on both ranks) is recorded; the stage parity above still reports
            zero = {"stage": 3}
            model = build(model_name, zero, "document_sdpa")
            sploss.enable_tiled_head(model, 8)
            tiles = tiling.enable_tiled_mlp(model, 8)
            loss, norm, update = step(model, ds_config(zero, 2, 2, 1, 2), mpu, rows,
                                      lambda e, b: [x / 7 for x in sploss.micro_loss(e, b, 2, sp_rank, 3, 8)])
            results["sp2/zero3_tiled"] = {"loss": 7 * distmod.mean_across_ranks([loss])[0], "norm": norm,
                                          "update": [7 * u for u in update], "tiled_mlps": tiles}
        except Exception:
            results["sp2/zero3_tiled"] = {"error": traceback.format_exc()}
        for family in (model_name, second_family):
            try:
                results[f"documents/{family}"] = document_losses(family, dist.rank)
            except Exception:
                results[f"documents/{family}"] = {"error": traceback.format_exc()}
    finally:
        if dist.rank == 0:
            with open(out_path, "w") as f:
                json.dump(results, f)
        distmod.teardown()
    return 0


if __name__ == "__main__":
    quick_start()  # harness/run.py's start-up, before DeepSpeed is imported
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    exit_now(main(*args))
