"""The top-k (+ tail) distillation loss written from TRL 1.16's server-distillation formulas, token by token in
float64, the reference of the top-k teacher tests. It does not call harness/distill."""

from __future__ import annotations

import torch


def topk_reference_sum(student, teacher, labels, k: int, beta: float, temperature: float, tail: bool):
    """Sum over the loss tokens of labels [B, L] (the token at t + 1 predicted at t) of the divergence between the
    student's logits [B, L, V] and the teacher's top-k (beta 0) or its top-1 and the actual token (beta > 0)."""
    total = torch.zeros((), dtype=torch.float64)
    for b in range(labels.shape[0]):
        for t in range(labels.shape[1] - 1):
            y = int(labels[b, t + 1])
            if y == -100:
                continue
            s = torch.log_softmax(student[b, t].double() / temperature, -1)
            tl = torch.log_softmax(teacher[b, t].double() / temperature, -1)
            top = tl.topk(k).indices.tolist()
            sup = top if beta == 0 else [y] if beta == 1 else [top[0]] + ([y] if y != top[0] else [])
            ps, pt = s[sup].exp(), tl[sup].exp()
            if tail:
                ps, pt = torch.cat([ps, 1 - ps.sum(0, keepdim=True)]), torch.cat([pt, 1 - pt.sum(0, keepdim=True)])
            else:
                ps, pt = ps / ps.sum(), pt / pt.sum()
            if beta == 0:
                d = (pt * (pt.log() - ps.log())).sum()
            elif beta == 1:
                d = (ps * (ps.log() - pt.log())).sum()
            else:
                m = beta * pt + (1 - beta) * ps
                d = beta * (pt * (pt / m).log()).sum() + (1 - beta) * (ps * (ps / m).log()).sum()
            total = total + d
    return total
