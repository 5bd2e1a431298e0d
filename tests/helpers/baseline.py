"""Single-process plain PyTorch training of the same model on the same batches: the parity reference."""

from __future__ import annotations

import torch

from harness.data.batches import BatchPlan
from harness.data.corpus import DataSpec
from harness.model.hf import build_model, load_tokenizer
from harness.data.rows import Rows, model_inputs, split_rows
from harness.data.store import prepare


def train_rows(model: str, seq_len: int, eval_fraction: float, seed: int, data: DataSpec = DataSpec(),
               store_dir: str | None = None, packing: str = "document") -> Rows:
    """The training split of the same prepared store a launch uses, packed as train.packing (default document)."""
    store, _ = prepare(data, load_tokenizer(model), seq_len, store_dir)
    return split_rows(Rows.of(store, packing), eval_fraction, seed)[0]


def plain_pytorch_losses(*, model: str, steps: int, seq_len: int, global_batch: int, lr: float, betas, eps: float,
                         weight_decay: float, clip: float, seed: int, eval_fraction: float,
                         data: DataSpec = DataSpec(), store_dir: str | None = None,
                         micro_batches: int = 1, adapter: dict | None = None, packing: str = "document",
                         trained: dict | None = None) -> list[float]:
    """AdamW + clip_grad_norm_ (on the trainable parameters: all, or the adapters) on all global_batch rows of each
    step. The step's loss is the mean of the losses
    of its `micro_batches` equal chunks (in rank order), as DeepSpeed averages rank and accumulation means: with
    masked labels the chunks hold different numbers of target tokens, so this is not the mean over all targets."""
    torch.manual_seed(seed)
    net = build_model(model, seed=seed).float().train()
    if adapter is not None:  # the same peft-wrapped model the launch trains (train/adapters.py)
        from harness.model import adapters

        adapters.apply(net, {"adapter": adapter, "train": {"seed": seed}, "activation_checkpointing": False})
    trainable = [(n, p) for n, p in net.named_parameters() if p.requires_grad]
    ratio = (adapter or {}).get("lr_B_ratio")  # LoRA+: B learns at lr x ratio
    groups = ([{"params": [p for n, p in trainable if ".lora_B." not in n]},
               {"params": [p for n, p in trainable if ".lora_B." in n], "lr": lr * ratio}] if ratio
              else [p for _, p in trainable])
    opt = torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
    rows = train_rows(model, seq_len, eval_fraction, seed, data, store_dir, packing)
    plan = BatchPlan(num_rows=rows.shape[0], global_batch=global_batch, micro_batch=global_batch, grad_accum=1,
                     seed=seed)
    out = []
    for step in range(steps):
        chunks = plan.global_rows(step).chunk(micro_batches)
        losses = [net(**model_inputs(rows[chunk].tensors()), use_cache=False).loss for chunk in chunks]
        loss = torch.stack(losses).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in net.parameters() if p.requires_grad], clip)
        opt.step()
        out.append(loss.item())
    if trained is not None:  # the trainable tensors after the last step, by name
        trained.update({n: p.detach().clone() for n, p in net.named_parameters() if p.requires_grad})
    return out
