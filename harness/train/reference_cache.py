"""The precomputed reference: one sharded pass over the pairs, cached by what determines its numbers.

Key: the reference (name and a fingerprint of its weight files: name, size, mtime; a preset: its seed), the run's
precision, and the pairs' store (its folder, named by the digest of data, tokenizer, seq_len and truncation). The
table is float64 [pairs, 2] (chosen, rejected summed log-probs by pair id), published atomically (a temporary file
renamed) into that store folder, so a resume or a second run reads it instead of loading the reference.

Rank 0 decides whether the cache is there and tells every rank (ranks on other nodes may not see its folder); then
either rank 0 reads the table or each rank computes its pairs (id % world == rank), and ONE all-reduce of the
[pairs, 2] table gives every rank the whole.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch

from harness import dist as distmod
from harness import model_shapes
from harness.train.reference_engine import build_engine, forward_logps, reference_name


def weights_fingerprint(name: str, seed: int) -> list:
    """What identifies the reference's weights without reading them."""
    if model_shapes.is_preset(name):
        return [name, "seed", seed]
    folder = Path(name)
    if not folder.is_dir():
        return [name]  # a hub id: its snapshot is what the HF cache holds under that name
    return [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in sorted(folder.iterdir())
            if p.suffix in (".safetensors", ".bin", ".json") and p.is_file()]


def cache_path(spec, folder: Path) -> Path:
    """The table's file in the pairs' store folder, whose name is already the digest of the data's key (dataset and
    its fingerprint, tokenizer, seq_len, truncation: harness/data/preference_store.py); this name adds the
    reference's and the precision's."""
    name = reference_name(spec)
    key = {"reference": name, "weights": weights_fingerprint(name, spec.recipe["train"]["seed"]),
           "precision": spec.run.precision, "store": Path(folder).name}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return Path(folder) / f"reference_logps-{digest}.npy"


def publish(table: torch.Tensor, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        np.save(f, table.numpy())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # atomic: a reader sees the whole table or none


def _shard_batches(pairs, rank: int, world: int, micro: int) -> list:
    """This rank's (split, positions) micro-batches, padded with repeats to the largest rank's count: under ZeRO-3
    every forward is collective, so every rank runs as many."""
    mine, counts = [], [0] * world
    for split in pairs:
        ids = split.ids.numpy()
        for r in range(world):
            pos = np.nonzero(ids % world == r)[0]
            counts[r] += -(-len(pos) // micro)
            if r == rank:
                mine += [(split, pos[i:i + micro], False) for i in range(0, len(pos), micro)]
    filler = next(((s, np.arange(1), True) for s in pairs if s.shape[0]), None)  # its result is dropped
    return mine + [filler] * (max(counts) - len(mine))


def compute(spec, dist, pairs, table: torch.Tensor) -> None:
    """Fill this rank's rows of `table` with the reference's summed log-probs (the reference built, then freed)."""
    engine, _ = build_engine(spec)
    micro = spec.run.batch.micro_batch
    for split, pos, filler in _shard_batches(pairs, dist.rank, dist.world_size, micro):
        view = split[pos]
        input_ids, labels = view.tensors()[:2]
        logps = forward_logps(engine, input_ids, labels).double().cpu()
        if not filler:
            half = logps.shape[0] // 2
            table[view.ids.long()] = torch.stack([logps[:half], logps[half:]], dim=1)
    engine.destroy()
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the policy's engine is built next


def table(spec, dist, pairs, folder: Path) -> tuple[torch.Tensor, Path | None]:
    """(float64 [pairs, 2] table by pair id, the cache file when it was read, else None)."""
    path = cache_path(spec, folder)
    num = max((int(s.ids.max()) + 1 for s in pairs if s.shape[0]), default=0)
    hit = distmod.broadcast_object(path.is_file() if dist.is_main else None)
    out = torch.zeros(num, 2, dtype=torch.float64)
    if hit:
        if dist.is_main:
            out = torch.from_numpy(np.load(path)).to(torch.float64)
    else:
        compute(spec, dist, pairs, out)
    if dist.world_size > 1:
        out = _sum_over_ranks(out, dist)
    if not hit and dist.is_main:
        publish(out, path)
    return out, path if hit else None


def _sum_over_ranks(t: torch.Tensor, dist) -> torch.Tensor:
    import torch.distributed as tdist

    on = t.to(dist.device) if tdist.get_backend() == "nccl" else t
    tdist.all_reduce(on)
    return on.cpu()
