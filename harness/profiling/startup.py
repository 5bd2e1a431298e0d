"""Seconds and peak memory of each start-up phase on every rank: the model build and the engine setup.

A phase resets the kernel's high-water mark first (/proc/self/clear_refs; on CUDA also the allocator's peak),
then records per rank:
  seconds                 wall time of the phase
  peak_rss_bytes          VmHWM at its end: peak resident set, including file pages mapped while reading a
                          checkpoint (so at most one checkpoint file above the private peak)
  peak_rss_anon_bytes     RssAnon sampled every SAMPLE_S during the phase: the private peak (tensors)
  rss_anon_before_bytes / rss_anon_after_bytes
  cuda_peak_allocated_bytes  (CUDA only) torch.cuda.max_memory_allocated during the phase
Rank 0 logs one line per rank and the summary gets {"startup": {"per_rank": [{phase: record}], ...}}, with the
planner's prediction of each rank's build bytes beside it (harness/planner/load.py).
"""

from __future__ import annotations

import contextlib
import time

from harness.profiling.proc import RssAnonPeak, malloc_free_bytes, reset_vm_hwm, status_bytes
from harness.profiling.ranks import gather

SAMPLE_S = 0.005
PHASES = ("build", "engine_setup")


class Startup:
    def __init__(self, device: str = "cpu"):
        self.cuda = str(device).startswith("cuda")
        self.device = device
        self.records: dict[str, dict] = {}

    @contextlib.contextmanager
    def phase(self, name: str):
        import torch

        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        reset = reset_vm_hwm()
        before = status_bytes("RssAnon")
        sampler = RssAnonPeak(SAMPLE_S)
        sampler.start()
        start = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - start
            peak = sampler.stop()
            after = status_bytes("RssAnon")
            free = malloc_free_bytes()
            record = {"seconds": round(seconds, 3), "peak_rss_bytes": status_bytes("VmHWM"),
                      "peak_rss_anon_bytes": max(peak, after or 0), "rss_anon_before_bytes": before,
                      "rss_anon_after_bytes": after, "hwm_reset": reset,
                      # in use (RssAnon less malloc's free bytes), the unit of memory.peak_in_use_bytes
                      "in_use_after_bytes": None if after is None or free is None else after - free}
            if self.cuda:
                record["cuda_peak_allocated_bytes"] = torch.cuda.max_memory_allocated(self.device)
            self.records[name] = record

    def report(self, predicted: dict | None = None) -> tuple[list[dict], list]:
        """(records per rank, predictions per rank) on every rank (collective: every rank calls)."""
        per_rank = gather({"records": self.records, "predicted": predicted})
        return [r["records"] for r in per_rank], [r["predicted"] for r in per_rank]


def _mib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**20:,.0f} MiB"


def render(per_rank: list[dict], predicted: list) -> list[str]:
    """One line per rank for the start-up log."""
    lines = []
    for rank, records in enumerate(per_rank):
        parts = []
        for name in PHASES:
            r = records.get(name)
            if r:
                cuda = f", cuda peak {_mib(r['cuda_peak_allocated_bytes'])}" if "cuda_peak_allocated_bytes" in r else ""
                parts.append(f"{name} {r['seconds']:.2f}s peak private {_mib(r['peak_rss_anon_bytes'])} "
                             f"(+{_mib(r['peak_rss_anon_bytes'] - (r['rss_anon_before_bytes'] or 0))}), "
                             f"peak rss {_mib(r['peak_rss_bytes'])}{cuda}")
        pred = predicted[rank] or {}
        if "build_bytes" in pred:
            parts.append(_predicted_build(pred["build_bytes"], records.get("build")))
        lines.append(f"rank {rank}: " + "; ".join(parts))
    return lines


def _predicted_build(predicted: int, build: dict | None) -> str:
    """The planner predicts the model's tensors a build holds (harness/planner/load.py), not what building costs
    a process besides them (library imports, allocator pools, module objects: some 80 MiB per rank on CPU): say
    so beside the measured rise instead of setting "+0 MiB" next to it for a small model."""
    text = f"predicted build +{predicted / 2**20:,.1f} MiB of model tensors"
    if build and build.get("rss_anon_before_bytes") is not None:
        rest = build["peak_rss_anon_bytes"] - build["rss_anon_before_bytes"] - predicted
        if rest > 0:
            text += f" (the other +{_mib(rest)} the build added is not modelled)"
    return text


def predict_build(spec, built) -> dict:
    """The planner's bytes for this rank's build (harness/planner/load.py). The tensors a pipeline or tp rank
    owns come from the model's shape through the planner's own stage split (so the engine's count tests it);
    ZeRO-3's partition and the largest tensor are read off the built module."""
    from harness import model_shapes
    from harness.model.build import zero3_by_module
    from harness.planner.load import build_bytes, owned_params
    from harness.planner.params import count_params

    params = list(built.module.parameters())
    zero3 = any(hasattr(p, "ds_tensor") for p in params)
    info = built.info
    if zero3:
        owned = sum(p.ds_tensor.numel() for p in params)
    else:
        method = spec.ds_config.get("pipeline", {}).get("partition", spec.recipe["parallel"]["partition_method"])
        owned = owned_params(count_params(info.config.to_dict()), pp=spec.pp, tp=spec.tp,
                             stage=getattr(built.module, "stage_id", 0), method=method)
    largest_tensor = max((getattr(p, "ds_numel", p.numel()) for p in params), default=0)
    largest_layer = max((sum(getattr(p, "ds_numel", p.numel()) for p in m.parameters(recurse=False))
                         for m in built.module.modules()), default=0)
    preset = model_shapes.is_preset(spec.recipe["train"]["model"])
    terms = build_bytes(owned_params=owned, train_dtype=info.train_dtype,
                        checkpoint_dtype="float32" if preset else info.checkpoint_dtype,
                        largest_tensor_params=largest_tensor, gathered_params=largest_layer if zero3 else 0,
                        zero3_fill=zero3 and zero3_by_module(spec),
                        source_params=info.num_params if preset and (spec.pp > 1 or spec.tp > 1) else 0)
    return {"build_bytes": terms["total"], "build_terms": terms, "owned_params": owned}


def report_startup(startup: Startup) -> tuple[list[str], dict]:
    """(one log line per rank, the summary.json entry); collective: every rank calls."""
    per_rank, predicted = startup.report(getattr(startup, "predicted", None))
    return render(per_rank, predicted), {
        "startup": {"per_rank": per_rank, "predicted_per_rank": predicted,
                    "note": f"peak_rss_anon_bytes: private memory, sampled every {SAMPLE_S * 1000:.0f} ms; "
                            "peak_rss_bytes: VmHWM (includes mapped file pages)"}}
