"""Single-process plain PyTorch training of the same model on the same batches: the parity reference."""

from __future__ import annotations

import torch

from harness.train.batches import BatchPlan
from harness.train.data import load_text_dataset, split_blocks, tokenize_and_pack
from harness.train.models import build_model, load_tokenizer


def train_blocks(model: str, seq_len: int, eval_fraction: float, seed: int) -> torch.Tensor:
    blocks = tokenize_and_pack(load_text_dataset("builtin"), load_tokenizer(model), seq_len)
    return split_blocks(blocks, eval_fraction, seed)[0]


def plain_pytorch_losses(*, model: str, steps: int, seq_len: int, global_batch: int, lr: float, betas, eps: float,
                         weight_decay: float, clip: float, seed: int, eval_fraction: float) -> list[float]:
    """AdamW + clip_grad_norm_ on all global_batch rows of each step at once (mean of equal rank means)."""
    torch.manual_seed(seed)
    net = build_model(model, seed=seed).float().train()
    opt = torch.optim.AdamW(net.parameters(), lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
    rows = train_blocks(model, seq_len, eval_fraction, seed)
    plan = BatchPlan(num_rows=rows.shape[0], global_batch=global_batch, micro_batch=global_batch, grad_accum=1,
                     seed=seed)
    out = []
    for step in range(steps):
        ids = rows[plan.global_rows(step)]
        loss = net(input_ids=ids, labels=ids, use_cache=False).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
        out.append(loss.item())
    return out
