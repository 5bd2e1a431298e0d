"""`rl.generator=hf`: transformers' generate on the policy's live weights, on every ZeRO stage.

Stages 0-2 and ddp hold whole weights: generate runs on the engine's module as it is. ZeRO-3 takes its weights
through generation/gather.py (whole, or layer groups within the planner's bound; never per token through ZeRO's
hooks). Parameter offload is covered by the same gathers (DeepSpeed fetches offloaded partitions), LoRA by running
the module as trained: the adapters stay active and nothing is merged."""

from __future__ import annotations

import contextlib

import torch

from harness.rl.generation import gather
from harness.rl.generation.sampling import RowSampler


def left_pad(prompts: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        if p:
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


def cut(row: list[int], eos_ids: set[int]) -> list[int]:
    """The completion as generated: up to and including the first EOS (what generate pads after it is dropped)."""
    for i, tok in enumerate(row):
        if tok in eos_ids:
            return row[:i + 1]
    return row


class HFGenerator:
    """Generator on the engine's module. bound_bytes: the planner's limit on gathered bytes under ZeRO-3 (None:
    gather the whole model once per call)."""

    name = "hf"

    def __init__(self, rl: dict, engine, tokenizer, *, bound_bytes: int | None, seed: int = 0):
        self.rl, self.engine, self.module = rl, engine, engine.module
        self.zero3 = gather.is_zero3(self.module)
        self.bound_bytes = bound_bytes
        eos = tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos])
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_ids)
        self.seed, self.calls = int(seed), 0
        self.last_groups: list[list[int]] = []
        self.last_logps: list[list[float]] = []  # the last call's sampling log-probs per row (row_ids calls)

    def _weights(self):
        if not self.zero3:
            return contextlib.nullcontext([])
        return gather.zero3_weights(self.engine, self.module, self.bound_bytes)

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], *, seed: int, first_row: int = 0,
                 row_ids: list[int] | None = None, max_new: int | None = None) -> list[list[int]]:
        """One completion per prompt (token ids, EOS included, at most max_new: max_completion_length unless
        given). Collective under ZeRO-3: every rank calls it the same number of times (a rank with no prompts
        still joins the gathers). row_ids (a multi-turn turn's rows): row i draws from (seed, row_ids[i]), and
        last_logps holds each row's sampling log-probs."""
        from transformers import GenerationConfig

        self.calls += 1
        rows = prompt_ids or [[self.pad_id]]  # a rank without prompts runs one dummy row to join the collectives
        max_new = int(max_new or self.rl.get("max_completion_length", 256))
        device = next(self.module.parameters()).device
        ids, mask = left_pad(rows, self.pad_id, device)
        if row_ids is not None and not prompt_ids:
            row_ids = [0]
        sampler = RowSampler(seed=seed, first_row=first_row, rows=len(rows), row_ids=row_ids,
                             temperature=float(self.rl.get("temperature", 1.0)), top_k=self.rl.get("top_k"),
                             top_p=self.rl.get("top_p"), record_logps=row_ids is not None)
        config = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=sorted(self.eos_ids),
                                  pad_token_id=self.pad_id, use_cache=True)
        was_training = self.module.training
        self.module.eval()
        try:
            with self._weights() as groups:
                self.last_groups = groups
                # grouped gathers are collectives in every forward: ranks keep stepping until all are done
                synced = self.zero3 and len(groups) > 1 and torch.distributed.is_initialized()
                out = self.module.generate(input_ids=ids, attention_mask=mask, generation_config=config,
                                           logits_processor=[sampler], synced_gpus=synced)
        finally:
            self.module.train(was_training)
        new = [cut(row, self.eos_ids) for row in out[:, ids.shape[1]:].tolist()][:len(prompt_ids)]
        if sampler.logps:
            logps = torch.stack(sampler.logps, dim=1).tolist()
            self.last_logps = [lp[:len(row)] for lp, row in zip(logps, new)]
        return new

    def after_step(self) -> None:
        """Nothing to sync: generate reads the live weights."""

    def state_dict(self) -> dict:
        return {"generator": self.name, "seed": self.seed, "calls": self.calls}

    def load_state_dict(self, state: dict) -> None:
        self.seed, self.calls = int(state["seed"]), int(state["calls"])
