"""Memory per rank: device/process memory every step, model-state bytes counted from the engine's tensors.

Process memory, every step, this rank:
  CUDA: peak_allocated_bytes / peak_reserved_bytes since the step began (peaks reset in before_step),
        allocated_bytes at the end of the step.
  CPU:  rss_bytes at the end of the step and peak_rss_bytes during it (Linux VmHWM, reset each step by
        writing 5 to /proc/self/clear_refs; where that is refused, the process's lifetime peak), and
        peak_rss_anon_bytes: private memory (tensors, not mapped file pages) sampled every 20 ms during the
        step; eval and checkpoint saves are outside it. peak_in_use_bytes: the same samples less what glibc's
        malloc holds free for reuse (it keeps freed tensors under 32 MB and grows step after step, hundreds of MB
        at 0.5B): the memory in use, like CUDA's allocated beside reserved, and what the planner's per-rank
        training peak predicts.
Model states, on profiled steps and the run's last step (right after the optimizer step), counted from the
tensors the engine holds, each storage once (by untyped_storage data_ptr; a view into a flat buffer counts
the whole buffer once), classified by where it was first found:
  params             module parameters, ZeRO-3 partitions (ds_tensor) and ZeRO's flat 16-bit groups
  grads / fp32_grads .grad and ZeRO gradient buffers (fp32_grads: fp32 ones when training in 16 bits)
  fp32_master        the tensors the inner optimizer updates, when they are not the module's parameters
  optimizer_moments  the inner optimizer's state (exp_avg, exp_avg_sq, step)
  reduce_buckets     ZeRO's ipg (reduce) buckets, and the gather buffers ZeRO-3 Muon keeps (_muon_allgather_buffers)
  offload_buffers    staging buffers for CPU/NVMe offload, and the pinned swap buffers of ZeRO-Infinity's
                     parameter swapper (reached through param.nvme_swapper) and optimizer swapper
  other              any other tensor attribute of the ZeRO optimizer, and scalars of <= 16 bytes anywhere
                     (grad norm, overflow flags, Adam's step count)
Device: the tensor's device type ("cuda", "cpu"), plus "nvme": bytes of this rank's ZeRO-Infinity swap
files under nvme_path (parameter swap files under params, optimizer swap files under optimizer_moments).
"""

from __future__ import annotations

import os
from pathlib import Path

from harness.profiling.proc import RssAnonPeak, malloc_free_bytes, reset_vm_hwm, status_bytes
from harness.profiling.ranks import gather, in_window

TERMS = ("params", "grads", "fp32_grads", "fp32_master", "optimizer_moments", "reduce_buckets",
         "offload_buffers", "other")
_MAX_DEPTH = 4
BOOKKEEPING_BYTES = 16
ANON_SAMPLE_S = 0.02


class _Counter:
    def __init__(self, lp_dtype):
        self.seen: set[int] = set()
        self.visited: set[int] = set()
        self.lp_dtype = lp_dtype
        self.bytes: dict[str, dict[str, int]] = {}

    def add(self, term: str, tensor) -> None:
        import torch

        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            return
        if term == "fp32_master" and tensor.is_leaf and tensor.grad is not None:
            # with offload_optimizer the fp32 gradient partition the CPU optimizer reads stays on the master
            # flat as .grad (ZeRO-3's pinned subgroup_gradient_buffer): a flat the optimizer's param_groups
            # alias, so it is reached here even when its storage was already counted
            self.add("fp32_grads", tensor.grad)
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or key in self.seen or storage.nbytes() == 0:
            return
        self.seen.add(key)
        if storage.nbytes() <= BOOKKEEPING_BYTES:  # scalars: grad norm, overflow flag, Adam's step
            term = "other"
        device = self.bytes.setdefault(term, {})
        device[tensor.device.type] = device.get(tensor.device.type, 0) + storage.nbytes()

    def term_for(self, name: str, tensor) -> str:
        import torch

        name = name.lower()
        if "offload" in name or "swap" in name or "pinned" in name:
            return "offload_buffers"
        if "ipg" in name or "bucket" in name:
            return "reduce_buckets"
        if "grad" in name:
            fp32 = tensor.dtype == torch.float32 and self.lp_dtype != torch.float32
            return "fp32_grads" if fp32 else "grads"
        if "fp32" in name or "master" in name:
            return "fp32_master"
        if "bit16" in name or "fp16" in name or "bf16" in name:
            return "params"
        return "other"

    def walk(self, obj, name: str, depth: int = 0, term: str | None = None) -> None:
        """Tensors held by obj's attributes, lists, dicts and plain objects (never modules); `term` forces
        the class of everything found below (else it follows the attribute names)."""
        import torch

        if isinstance(obj, torch.Tensor):
            self.add(term or self.term_for(name, obj), obj)
            return
        if depth > _MAX_DEPTH or id(obj) in self.visited or isinstance(obj, (torch.nn.Module, str, bytes)):
            return
        self.visited.add(id(obj))
        if isinstance(obj, dict):
            for value in list(obj.values()):
                self.walk(value, name, depth + 1, term)
        elif isinstance(obj, (list, tuple, set)):
            for value in list(obj):
                self.walk(value, name, depth + 1, term)
        elif hasattr(obj, "__dict__") and type(obj).__module__.startswith(("deepspeed", "torch.optim")):
            for attr, value in list(vars(obj).items()):
                self.walk(value, attr if depth == 0 else f"{name}.{attr}", depth + 1, term)


def model_state_bytes(engine) -> dict[str, dict[str, int]]:
    """{term: {device: bytes}} this rank holds for the model and its training state (see module doc)."""
    params = list(engine.module.parameters())
    lp_dtype = params[0].dtype if params else None
    c = _Counter(lp_dtype)
    for p in params:
        c.add("params", p)
        c.add("params", getattr(p, "ds_tensor", None))
    for p in params:
        if p.grad is not None:
            c.add(c.term_for("grad", p.grad), p.grad)
    # ZeRO-Infinity: the parameter swapper (pinned swap buffers) hangs off each parameter, not the optimizer
    swappers = {id(s): s for s in (getattr(p, "nvme_swapper", None) for p in params) if s is not None}
    for swapper in swappers.values():
        c.walk(swapper, "nvme_swapper", term="offload_buffers")
    wrapper = engine.optimizer
    inner = getattr(wrapper, "optimizer", wrapper)
    for group in getattr(inner, "param_groups", []):
        for p in group["params"]:
            c.add("fp32_master", p)
    for state in getattr(inner, "state", {}).values():
        for value in state.values():
            c.add("optimizer_moments", value)
    # ZeRO-1/2 Muon: the momentum staged while gradients are folded in (stage_1_and_2._muon_pending_momentum)
    for staged in getattr(wrapper, "_muon_pending_momentum", {}).values():
        for value in staged if isinstance(staged, (tuple, list)) else (staged,):
            c.add("optimizer_moments", value)
    c.walk(getattr(wrapper, "_muon_allgather_buffers", {}), "muon_gathers", term="reduce_buckets")
    if wrapper is not None and wrapper is not inner:
        c.walk(wrapper, "optimizer")
    return {term: dict(sorted(c.bytes[term].items())) for term in TERMS if term in c.bytes}


def nvme_swap_bytes(ds_config: dict, rank: int) -> dict[str, int]:
    """Bytes in this rank's ZeRO-Infinity swap files: {"params": n, "optimizer": n} (empty without nvme)."""
    zo = ds_config.get("zero_optimization", {})
    roots = {(zo.get(block) or {}).get("nvme_path") for block in ("offload_param", "offload_optimizer")
             if (zo.get(block) or {}).get("device") == "nvme"}
    out: dict[str, int] = {}
    folder = f"rank{rank}"
    for root in filter(None, roots):
        for dirpath, _, files in os.walk(root):
            parts = Path(dirpath).parts
            if folder not in parts:
                continue
            kind = "optimizer" if "optimizer" in parts else "params"
            out[kind] = out.get(kind, 0) + sum(os.path.getsize(os.path.join(dirpath, f)) for f in files)
    return out


def with_nvme(states: dict, swap: dict[str, int]) -> dict:
    out = {term: dict(devices) for term, devices in states.items()}
    for kind, term in (("params", "params"), ("optimizer", "optimizer_moments")):
        if swap.get(kind):
            out.setdefault(term, {})["nvme"] = swap[kind]
    return out


class ProcessMemory:
    """Per-step memory of this process on its accelerator, or on the CPU."""

    def __init__(self, device: str):
        import psutil

        self.cuda = device.startswith("cuda")
        self.device = device
        self.process = psutil.Process()
        self.per_step_peak = True
        self.anon: RssAnonPeak | None = None  # started on the first step, polls until close()

    def reset(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.per_step_peak = reset_vm_hwm()
            if self.anon is None:
                self.anon = RssAnonPeak(ANON_SAMPLE_S)
                self.anon.start()
            self.anon.reset()

    def close(self) -> None:
        if self.anon is not None:
            self.anon.stop()

    def read(self) -> dict:
        if self.cuda:
            import torch

            return {"peak_allocated_bytes": torch.cuda.max_memory_allocated(self.device),
                    "peak_reserved_bytes": torch.cuda.max_memory_reserved(self.device),
                    "allocated_bytes": torch.cuda.memory_allocated(self.device)}
        rss = self.process.memory_info().rss
        out = {"rss_bytes": rss, "peak_rss_bytes": max(rss, status_bytes("VmHWM") or rss)}
        if self.anon is not None:
            self.anon.sample()
            out["peak_rss_anon_bytes"] = self.anon.peak
            if malloc_free_bytes() is not None:
                out["peak_in_use_bytes"] = self.anon.in_use_peak
        return out


class MemoryHook:
    def __init__(self, spec, engine, dist, window, prediction: dict):
        self.engine, self.dist, self.window = engine, dist, window
        self.ds_config = spec.ds_config
        self.prediction = prediction
        self.process = ProcessMemory(dist.device)
        self.peak: dict[str, int] = {}
        self.last_step = spec.recipe["train"]["steps"]
        self.states: dict | None = None  # from the last profiled step, or the run's last step
        self.states_step: int | None = None

    def before_step(self, step: int) -> None:
        self.process.reset()

    def _states(self) -> dict:
        return with_nvme(model_state_bytes(self.engine), nvme_swap_bytes(self.ds_config, self.dist.rank))

    def after_step(self, step: int) -> dict:
        mem = self.process.read()
        for key, value in mem.items():
            if key.startswith("peak"):
                self.peak[key] = max(self.peak.get(key, 0), value)
        record = {"memory": mem}
        profiled = in_window(step, self.window)
        # Counted right after a step: eval and checkpointing can leave ZeRO-3 parameters gathered.
        if profiled or step + 1 == self.last_step:
            self.states, self.states_step = self._states(), step + 1
        if profiled:
            per_rank = gather({"memory": mem, "model_states": self.states})
            record.update(profiled=True, memory_per_rank=[r["memory"] for r in per_rank],
                          model_states_per_rank=[r["model_states"] for r in per_rank])
        return record

    def close(self) -> dict:
        self.process.close()
        if self.states is None:  # resumed past the last step: count now
            self.states, self.states_step = self._states(), None
        per_rank = gather({"peak": self.peak, "model_states": self.states,
                           "nvme": nvme_swap_bytes(self.ds_config, self.dist.rank),
                           "predicted": self.prediction.get("after_step"),
                           "predicted_peak": self.prediction.get("peak_total_bytes")})
        out = {"peak_per_rank": [r["peak"] for r in per_rank],
               "model_states_per_rank": [r["model_states"] for r in per_rank],
               "model_states_step": self.states_step,
               "nvme_swap_bytes_per_rank": [r["nvme"] for r in per_rank],
               "device": "cuda" if self.process.cuda else "cpu",
               "predicted": {k: v for k, v in self.prediction.items() if k != "comm"},
               # each rank's own prediction: they differ where the layout does (ZeRO-1/2 partition edges)
               "predicted_after_step_per_rank": [r["predicted"] for r in per_rank],
               # model states at their peak + activations, each rank's own (pipeline stages differ)
               "predicted_peak_total_per_rank": [r["predicted_peak"] for r in per_rank]}
        if not self.process.cuda and not self.process.per_step_peak:
            out["note"] = "peak_rss_bytes is the process's lifetime peak (/proc/self/clear_refs was refused)"
        return {"memory": out}
