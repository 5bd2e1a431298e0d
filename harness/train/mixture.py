"""A mixture's per-source numbers in the loop: loss/<name> and rows/<name> per step, eval_loss/<name> per eval,
and the blend carried through a checkpoint (harness/data/mixture.py, blend.py).

loss/<name> is the mean token loss of that source's rows in the step, over every rank: each micro-batch's
per-token cross-entropy (from the logits the forward already made, detached) summed per source, with the
targets counted, and divided once the sums are all-reduced at the flush. rows/<name> counts the rows each rank
actually read, summed over the data-parallel replicas (the tensor- and sequence-parallel ranks of a replica read
the same rows and are counted once). Paths that hand back no logits (pipeline, sequence parallel, tiled loss, a
MoE model's balancing loss aside) log rows/<name> only.
"""

from __future__ import annotations

import numpy as np
import torch

from harness.data.rows import IGNORE_INDEX
from harness.dist import DistInfo

LOSS_TILE_POSITIONS = 2048  # positions per cross-entropy call of token_sums
SUMS_KEY = "source_sums"  # a step record's [3, S] tensor until the flush turns it into loss/<name>, rows/<name>


def token_sums(logits: torch.Tensor, labels: torch.Tensor, sources: np.ndarray, num: int) -> torch.Tensor:
    """[3, num]: summed token loss, targets and rows of each source in one micro-batch (rows: `sources`). The fp32
    cross-entropy runs over LOSS_TILE_POSITIONS positions of one row at a time, so its transient copy of the logits is one
    tile's (LOSS_TILE_POSITIONS x vocab x 4 bytes), not the micro-batch's."""
    shift_labels = labels[:, 1:].to(logits.device)
    per_row = torch.zeros(logits.shape[0], dtype=torch.float64, device=logits.device)
    for row in range(logits.shape[0]):
        for lo in range(0, shift_labels.shape[1], LOSS_TILE_POSITIONS):
            hi = min(lo + LOSS_TILE_POSITIONS, shift_labels.shape[1])
            part = torch.nn.functional.cross_entropy(logits[row, lo:hi].detach().float(), shift_labels[row, lo:hi],
                                                     ignore_index=IGNORE_INDEX, reduction="sum")
            per_row[row] += part.double()
    targets = (shift_labels != IGNORE_INDEX).sum(dim=1).double()
    index = torch.as_tensor(sources, dtype=torch.long, device=per_row.device)
    out = torch.zeros(3, num, dtype=torch.float64, device=per_row.device)
    out[0].index_add_(0, index, per_row)
    out[1].index_add_(0, index, targets)
    out[2].index_add_(0, index, torch.ones_like(per_row))
    return out


def by_source(step_fn, num: int, forward=None, lm_aux=None):
    """A step function (engine, batches, sources per micro-batch) -> (loss, parts with SUMS_KEY): the plain path's
    micro-steps with the sums when `forward` (the trainer's, and its MoE split `lm_aux`) is given, else `step_fn`
    with the rows only."""

    def rows_only(engine, batches, sources):
        loss = step_fn(engine, batches)
        loss, parts = loss if isinstance(loss, tuple) else (loss, {})
        sums = torch.zeros(3, num, dtype=torch.float64)
        for ids in sources:
            sums[2] += torch.bincount(torch.as_tensor(ids), minlength=num).double()
        sums[0] = float("nan")
        return loss, {**parts, SUMS_KEY: sums}

    def with_sums(engine, batches, sources):
        total, parts, sums = None, None, None
        for batch, ids in zip(batches, sources):
            out = forward(engine, batch)
            engine.backward(out.loss)
            engine.step()
            part = token_sums(out.logits, batch[1], ids, num)
            sums = part if sums is None else sums + part
            total = out.loss.detach().float() if total is None else total + out.loss.detach().float()
            if (split := lm_aux(engine, out)) is not None:
                parts = list(split) if parts is None else [a + b for a, b in zip(parts, split)]
        extra = {} if parts is None else {"lm_loss": parts[0] / len(batches), "aux_loss": parts[1] / len(batches)}
        return total / len(batches), {**extra, SUMS_KEY: sums}

    return with_sums if forward is not None else rows_only


def plain_path(spec) -> bool:
    """Whether the run's step is the plain micro-steps (its forward returns logits)."""
    from harness.config.preference_rules import is_preference
    from harness.model.sequence import steps as sequence

    return spec.pp == 1 and not is_preference(spec.recipe) and not sequence.uses_sequence_path(spec)


def flush_sources(pending: list, names: list[str], replicas: int) -> None:
    """Turn the pending records' SUMS_KEY tensors into loss/<name> and rows/<name> (one all-reduce).
    replicas: ranks that read the same rows (world / dp)."""
    import torch.distributed as dist

    held = [record for _, _, record in pending if SUMS_KEY in record]
    if not held:
        return
    nccl = dist.is_initialized() and dist.get_backend() == "nccl"  # NCCL reduces device tensors only
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    sums = torch.stack([record.pop(SUMS_KEY).to(device) for record in held])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sums)
    for record, value in zip(held, sums.cpu()):
        for s, name in enumerate(names):
            loss, targets, rows = value[0, s].item(), value[1, s].item(), value[2, s].item() / replicas
            record[f"rows/{name}"] = int(round(rows))
            if not np.isnan(loss):
                record[f"loss/{name}"] = loss / targets if targets else None


def source_evals(evaluate, engine, spec, dist: DistInfo, data) -> dict:
    """eval_loss/<name>: evaluate() on each source's own held-out rows."""
    import dataclasses

    out = {}
    for s, name in enumerate(data.mixture.names):
        rows = data.eval.source(s)
        if len(rows) == 0:
            continue
        out[f"eval_loss/{name}"] = evaluate(engine, spec, dist, dataclasses.replace(data, eval=rows))["eval_loss"]
    return out
