"""The reference model of dpo / ipo: its summed log-probs of each pair's two completions, in one of three modes.

precomputed  one pass of the reference over the train AND eval pairs before the policy is built, sharded (rank r
             takes the pairs with id % world == r), gathered into a float64 [pairs, 2] table (one all-reduce),
             cached beside the pairs' token store (reference_cache.py) and read by pair id at each step
engine       a frozen DeepSpeed engine of the reference (no optimizer or scheduler block: trl#825), ZeRO-3-sharded
             when the policy is ZeRO-3 (its offload_param as the policy's), else a stage-0 copy; a no_grad forward
             per micro-batch
adapter      under LoRA the policy's own base with the adapters switched off (no second copy), a no_grad forward
             through the policy's engine (ZeRO-3 gathers its shards as for any forward)

The reference is built by the policy's own path (harness/model/build.py) in the run's precision; it never reaches a
checkpoint or an export (it is not part of the policy's engine).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import torch

from harness.config.defaults import PRECISION_BYTES
from harness.config.preference_rules import reference_mode
from harness.train.reference_engine import build_engine, forward_logps, reference_name


@contextlib.contextmanager
def adapters_off(module):
    """The LoRA model as its base, in eval mode (no dropout, as the other modes' reference): every peft layer's
    adapters skipped, restored on exit. The flag is set directly: peft's enable_adapters also flips requires_grad,
    which the engine's gradient hooks were set up with."""
    layers = [m for m in module.modules() if hasattr(m, "_disable_adapters")]
    before, training = [m._disable_adapters for m in layers], module.training
    for m in layers:
        m._disable_adapters = True
    module.eval()
    try:
        yield
    finally:
        module.train(training)
        for m, state in zip(layers, before):
            m._disable_adapters = state


@dataclasses.dataclass
class Reference:
    """What a step asks: `logps(policy_engine, input_ids, labels, ids)` -> the reference's [2B] sums."""

    mode: str
    table: torch.Tensor | None = None  # precomputed: float64 [pairs, 2] (chosen, rejected) by pair id
    engine: object = None  # engine mode: the frozen reference engine

    def logps(self, policy, input_ids, labels, ids) -> torch.Tensor:
        if self.mode == "precomputed":
            rows = self.table[ids.long()]
            return torch.cat([rows[:, 0], rows[:, 1]]).to(policy.device)
        if self.mode == "engine":
            return forward_logps(self.engine, input_ids, labels)
        with adapters_off(policy.module):
            return forward_logps(policy, input_ids, labels)


def cost_line(spec, mode: str, num_pairs: int, info=None, seconds: float | None = None) -> str:
    """The start-up line naming the mode and what it costs."""
    name = reference_name(spec)
    if mode == "adapter":
        return "reference: adapter (the policy's base with the LoRA adapters off): no second copy, one more forward " \
               "per micro-batch"
    if mode == "precomputed":
        took = f" in {seconds:.1f}s" if seconds is not None else ""
        return (f"reference: precomputed from {name}: {num_pairs} pairs x 2 log-probs = {num_pairs * 16} bytes on the "
                f"host{took}, no reference forward during training")
    params, width = info.num_params, PRECISION_BYTES[spec.run.precision]
    shards = spec.world_size if spec.zero_stage == 3 else 1
    return (f"reference: engine of {name}: {params * width / shards / 2**20:.1f} MiB of {spec.run.precision} weights "
            f"per rank ({'ZeRO-3 sharded' if shards > 1 else 'a whole copy'}), one more forward per micro-batch")


def start(spec, dist, data, run_dir, say) -> Reference | None:
    """The run's reference (None: simpo, orpo), announced on rank 0; precomputed before the policy exists, over
    data.train and data.eval (Pairs, harness/data/preference.py), cached in their store's folder."""
    mode = reference_mode(spec.recipe)
    if mode is None:
        if dist.is_main:
            say("pref", f"reference: none ({spec.recipe['train']['objective']} has no reference model)")
        return None
    pairs = (data.train, data.eval)
    num = sum(p.shape[0] for p in pairs)
    if mode == "adapter":
        ref = Reference(mode)
        line = cost_line(spec, mode, num)
    elif mode == "engine":
        engine, info = build_engine(spec)
        ref, line = Reference(mode, engine=engine), cost_line(spec, mode, num, info)
    else:
        from harness.train import reference_cache

        began = time.perf_counter()
        folder = getattr(data.train, "path", None) or run_dir  # the pairs' store folder
        table, cached = reference_cache.table(spec, dist, pairs, folder)
        ref = Reference(mode, table=table)
        line = cost_line(spec, mode, num, seconds=time.perf_counter() - began) + (
            f"; read from {cached}" if cached else "")
    if dist.is_main:
        say("pref", line)
    return ref
