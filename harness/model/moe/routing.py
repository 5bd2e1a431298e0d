"""Tokens per expert per MoE layer, counted by a forward hook on each HF router (its forward returns the router
logits, the top-k scores and the top-k expert indices, in every family of config/moe_families.py) or, under
DeepSpeed AutoEP (parallel.expert > 1), on each AutoEPMoELayer's router (TokenChoiceTopKRouter: top-k scores, the
top-k GLOBAL expert indices of this rank's tokens, a histogram), named after the HF router it replaced so both
layouts report the same layers. Used on profiled steps (the report's imbalance, max / mean per layer) and by the tests that route ranks to
disjoint experts."""

from __future__ import annotations

import torch

from harness.config import moe_families

AUTOEP_LAYER = "AutoEPMoELayer"  # deepspeed/module_inject/auto_ep_layer.py: replaces the HF MoE block


class ExpertCounter:
    """Forward hooks on the routers of `model`; .counts[layer] is a tensor of tokens routed to each expert (a token
    sent to top_k experts counts once at each) since the last reset()."""

    def __init__(self, model, family: moe_families.Family, num_experts: int):
        self.num_experts = num_experts
        self.counts: dict[str, torch.Tensor] = {}
        self.handles = []
        for name, module in model.named_modules():
            if type(module).__name__ == family.router_class:  # HF: (logits, scores, indices)
                self.handles.append(module.register_forward_hook(self._hook(name, -1)))
            elif type(module).__name__ == AUTOEP_LAYER:  # AutoEP: (scores, indices, histogram)
                self.handles.append(module.router.register_forward_hook(self._hook(f"{name}.{family.router}", 1)))

    def _hook(self, name: str, index: int):
        def count(module, args, output):
            indices = output[index].detach().reshape(-1).to("cpu", torch.long)
            seen = torch.bincount(indices, minlength=self.num_experts)
            self.counts[name] = self.counts[name] + seen if name in self.counts else seen
        return count

    def reset(self) -> None:
        self.counts = {}

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def table(self) -> dict[str, list[int]]:
        return {name: counts.tolist() for name, counts in sorted(self.counts.items())}


def imbalance(counts: list[int]) -> float:
    """max / mean tokens per expert (1.0 = perfectly balanced; num_experts = every token on one expert)."""
    mean = sum(counts) / len(counts) if counts else 0
    return max(counts) / mean if mean else float("nan")


def counter_for(model) -> ExpertCounter | None:
    family = moe_families.family_of(getattr(model, "config", None))
    if family is None:
        return None
    return ExpertCounter(model, family, moe_families.num_experts(family, model.config))
