"""A plain-torch Muon + AdamW step written from the published formula, for checking DeepSpeed's Muon.

Muon (Keller Jordan, https://kellerjordan.github.io/posts/muon/), as DeepSpeed 0.19.8 configures it
(runtime/zero/muon/original_muon.py muon_update, MuonWithAuxAdam.step):
    m <- beta m + (1 - beta) g                      momentum (torch's lerp)
    u <- (1 - beta) g + beta m                      Nesterov
    O <- NewtonSchulz5(u / ||u||_F)                 5 quintic steps, a, b, c = 3.4445, -4.7750, 2.0315, on the wide side
    W <- W (1 - lr wd) - lr sqrt(max(1, rows / cols)) O
on every parameter of 2+ dimensions whose name has neither 'embed' nor 'lm_head'; AdamW (decoupled decay, bias
correction) on the rest, each with its own lr (muon_lr, adam_lr). DeepSpeed's default Newton-Schulz is the Gram
form, equal in exact arithmetic; on CPU both run in fp32 here.
"""
from __future__ import annotations

import math

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5


def newton_schulz(g: torch.Tensor, steps: int = NS_STEPS) -> torch.Tensor:
    a, b, c = NS_COEFFICIENTS
    x = g.double()
    wide = x.size(0) <= x.size(1)
    x = x if wide else x.T
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        A = x @ x.T
        x = a * x + (b * A + c * A @ A) @ x
    return (x if wide else x.T).to(g.dtype)


def takes_muon(name: str, p: torch.Tensor) -> bool:
    return p.dim() >= 2 and not any(k in name.lower() for k in ("embed", "lm_head"))


def reference_steps(model, ids: torch.Tensor, steps: int, hp: dict) -> dict:
    """Train `model` (fp32) `steps` steps on the whole batch `ids`; the losses, the weights after each step and the
    names Muon steps."""
    params = dict(model.named_parameters())
    muon = {n for n, p in params.items() if takes_muon(n, p)}
    state = {n: {"m": torch.zeros_like(p), "v": torch.zeros_like(p)} for n, p in params.items()}
    initial = {n: p.detach().clone() for n, p in params.items()}
    b1, b2 = hp["betas"]
    losses, weights = [], []
    for step in range(1, steps + 1):
        model.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(float(loss))
        with torch.no_grad():
            for n, p in params.items():
                g, s = p.grad, state[n]
                if n in muon:
                    s["m"].lerp_(g, 1 - hp["momentum"])
                    u = g.lerp(s["m"], hp["momentum"])
                    rows, cols = u.shape[-2], u.shape[-1]
                    o = newton_schulz(u) * math.sqrt(max(1.0, rows / cols))
                    p.mul_(1 - hp["muon_lr"] * hp["weight_decay"]).add_(o, alpha=-hp["muon_lr"])
                else:
                    s["m"].mul_(b1).add_(g, alpha=1 - b1)
                    s["v"].mul_(b2).addcmul_(g, g, value=1 - b2)
                    m_hat, v_hat = s["m"] / (1 - b1 ** step), s["v"] / (1 - b2 ** step)
                    p.mul_(1 - hp["adam_lr"] * hp["weight_decay"]).add_(m_hat / (v_hat.sqrt() + hp["eps"]),
                                                                         alpha=-hp["adam_lr"])
        weights.append({n: p.detach().clone() for n, p in params.items()})
    return {"losses": losses, "weights": weights, "initial": initial, "muon": muon}
