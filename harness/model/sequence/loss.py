"""The loss under sequence parallelism (and with the tiled head): exact gradients without a differentiable
collective.

Each rank holds a slice of each row's sequence. Its loss is the SUM of its token losses over the count of
loss-carrying tokens of the whole micro-batch of its replica (every SP rank holds the full rows on the host, so the
count needs no collective). The gradients of the SP ranks then add up to the replica's mean-loss gradient, which
the engine averages over data-parallel replicas as at sp=1. What the engine divides by differs per ZeRO stage
(measured, tests/test_sequence_parallel.py): ZeRO-0/1/2 divide the sum over the sp x dp ranks by dp (world / sp),
ZeRO-3 by sp x dp; `engine_factor` undoes the difference so sp=N gives the sp=1 gradient. The logged loss is the
rank's loss x sp, whose mean over all ranks is the mean over replicas of each replica's token mean (the sp=1 value).

The tiled head (train.tiled_loss) computes lm_head + cross-entropy tile by tile: logits exist for one tile at a
time, and the gradients of the hidden states and of lm_head's weight are computed in forward (tile by tile) and
scaled by the incoming gradient in backward, so a loss rescaled after it (1/accumulation, a factor) stays right
for both (DeepSpeed's TiledFusedLogitsLoss gets lm_head's wrong: docs/deepspeed-facts.md, "Sequence
parallelism").
"""

from __future__ import annotations

import torch


def engine_factor(zero_stage: int, sp: int) -> float:
    """What the loss is multiplied by so the engine's reduction yields the replica-mean gradient."""
    return float(sp) if zero_stage == 3 else 1.0


class TiledHeadLoss(torch.autograd.Function):
    """sum over tokens of cross_entropy(hidden @ weight.T, labels) (ignore -100), computed `tile` rows at a time."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, tile: int):
        flat, targets = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
        want = hidden.requires_grad  # False under no_grad (eval): no gradients computed
        want_w = want and weight.requires_grad  # False for a frozen head (LoRA)
        grad_h = torch.zeros_like(flat) if want else None
        grad_w = torch.zeros_like(weight) if want_w else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, flat.shape[0], tile):
            rows = slice(start, start + tile)
            if not (targets[rows] != -100).any():
                continue
            with torch.enable_grad():
                h = flat[rows].detach().requires_grad_(want)
                w = weight.detach().requires_grad_(want_w)
                logits = (h @ w.t()).float()
                part = torch.nn.functional.cross_entropy(logits, targets[rows], ignore_index=-100, reduction="sum")
                if want:
                    grads = torch.autograd.grad(part, (h, w) if want_w else (h,))
                    grad_h[rows] += grads[0]
                    if want_w:
                        grad_w += grads[1]
            total += part.detach()
        ctx.has_w = want_w
        ctx.save_for_backward(*((grad_h.view_as(hidden),) if want else ()), *((grad_w,) if want_w else ()))
        return total

    @staticmethod
    def backward(ctx, grad):
        saved = ctx.saved_tensors
        grad_w = saved[1] * grad.to(saved[1].dtype) if ctx.has_w else None
        return saved[0] * grad.to(saved[0].dtype), grad_w, None, None


def _tiled_forward(head):
    """lm_head.forward that returns the summed tiled loss (shape [1, 1, 1], as `logits`) while labels are set."""
    plain = head.forward

    def forward(hidden):
        labels = head.__dict__.get("_harness_labels")
        if labels is None:
            return plain(hidden)
        if head.bias is not None:
            raise RuntimeError("the tiled loss supports an lm_head without bias only")
        liger = _liger() if hidden.is_cuda else None
        if liger is not None:  # Liger's fused linear cross-entropy (Triton, GPU): chunked the same way
            flat = hidden.reshape(-1, hidden.shape[-1])
            out = liger(flat, head.weight, labels.reshape(-1), ignore_index=-100, reduction="sum")
            return (out[0] if isinstance(out, tuple) else out).float().reshape(1, 1, 1)  # versions: (loss, z_loss)
        return TiledHeadLoss.apply(hidden, head.weight, labels, head._harness_tile).reshape(1, 1, 1)

    return forward


def _liger():
    """liger_kernel's fused linear cross-entropy where installed (GPU only; not exercised on this CPU machine)."""
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except ImportError:
        return None
    return liger_fused_linear_cross_entropy


def output_head(module):
    """The lm_head of an HF causal LM, also inside a PEFT wrapper."""
    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    return base.get_output_embeddings()


def enable_tiled_head(module, tile: int) -> None:
    head = output_head(module)
    if "_harness_tile" not in head.__dict__:
        head.forward = _tiled_forward(head)
    head._harness_tile = tile


def summed_loss(engine, ids, labels, positions, tile: int | None):
    """Sum of this shard's token losses; `labels` are already shifted (position t carries label t+1)."""
    if tile:
        head = output_head(engine.module)
        head._harness_labels = labels
        try:
            return engine(input_ids=ids, position_ids=positions, use_cache=False).logits.reshape(())
        finally:
            head._harness_labels = None
    logits = engine(input_ids=ids, position_ids=positions, use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                             ignore_index=-100, reduction="sum")


def micro_loss(engine, batch, sp: int, sp_rank: int, zero_stage: int, tile: int | None):
    """(loss to backward, loss to log) of one micro-batch on this rank."""
    from harness.model.sequence.ulysses import shard, shift_labels

    count = max(int((shift_labels(batch[1]) != -100).sum()), 1)  # the replica's tokens, from the host copy
    ids, labels, positions = (t.to(engine.device) for t in shard(batch, sp_rank, sp))
    summed = summed_loss(engine, ids, labels, positions, tile)
    mean_part = summed / count
    return mean_part * engine_factor(zero_stage, sp), mean_part.detach() * sp
