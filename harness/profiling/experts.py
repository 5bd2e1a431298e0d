"""Tokens per expert per MoE layer on profiled steps (harness/model/moe/routing.py's router hook), summed over ranks.

The hooks are attached only inside the profile window (each count copies the router's top-k indices to the host).
Each profiled step's record gets "expert_tokens" {layer: [tokens per expert]} (all ranks) and "expert_imbalance"
{layer: max / mean}; the summary gets the per-layer imbalance over the window, which `harness report` shows. Under
DeepSpeed AutoEP the hook sits on AutoEP's router instead (global expert ids of each rank's own tokens), so the sum
over all ranks is the same table as without expert parallelism.
"""

from __future__ import annotations

from harness.profiling.ranks import in_window


class ExpertHook:
    def __init__(self, engine, window: tuple[int, int]):
        self.engine, self.window = engine, window
        self.counter = None
        self.total: dict[str, list[int]] = {}

    def before_step(self, step: int) -> None:
        from harness.model.moe.routing import counter_for

        if in_window(step, self.window) and self.counter is None:
            self.counter = counter_for(self.engine.module)

    def after_step(self, step: int) -> dict | None:
        if not in_window(step, self.window) or self.counter is None:
            return None
        import torch
        import torch.distributed as dist

        from harness.model.moe.routing import imbalance

        table = self.counter.table()
        self.counter.reset()
        if not table:  # no router ran (no MoE block in this model)
            return None
        layers = sorted(table)
        counts = torch.tensor([table[name] for name in layers], dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(counts)  # torch.distributed: never comms-logged
        tokens = {name: [int(n) for n in row] for name, row in zip(layers, counts.tolist())}
        for name, row in tokens.items():
            self.total[name] = [a + b for a, b in zip(self.total.get(name, [0] * len(row)), row)]
        if step + 1 >= self.window[1]:
            self.counter.close()
            self.counter = None
        return {"expert_tokens": tokens, "expert_imbalance": {n: imbalance(r) for n, r in tokens.items()}}

    def close(self) -> dict:
        if self.counter is not None:
            self.counter.close()
        if not self.total:
            return {}
        from harness.model.moe.routing import imbalance

        return {"experts": {"tokens_per_layer": self.total,
                            "imbalance_per_layer": {n: imbalance(r) for n, r in self.total.items()}}}


def hook_for(engine, window) -> ExpertHook | None:
    """An ExpertHook for a MoE model with a profile window, else None."""
    from harness.config.moe_families import family_of

    module = getattr(engine, "module", None)
    if window is None or family_of(getattr(module, "config", None)) is None:
        return None
    return ExpertHook(engine, window)
