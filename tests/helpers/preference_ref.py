"""A plain-torch DPO / IPO / SimPO / ORPO, written from issue 32's formulas (TRL's), the parity reference of the
preference tests: one process, HF models, the same pairs each rank of a launch takes (the harness's pair store and
BatchPlan), SGD (p -= lr x grad) with no clipping. It does not call the harness's objective, step or reference code.
Also the tests' tiny preference set (prompt / chosen / rejected strings)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from harness.data.batches import BatchPlan

WORDS = ("the cat sat on a mat while river stones hum quietly under green light and every clock ticks "
         "toward noon but birds argue about bread crumbs near old wooden benches").split()


def write_pairs(path: Path, count: int = 16, seed: int = 5) -> Path:
    rng = random.Random(seed)
    phrase = lambda lo, hi: " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))  # noqa: E731
    with open(path, "w") as f:
        for _ in range(count):
            f.write(json.dumps({"prompt": phrase(2, 5), "chosen": phrase(2, 8), "rejected": phrase(2, 8)}) + "\n")
    return Path(path)


METRICS = ("rewards_chosen", "rewards_rejected", "rewards_margin", "rewards_accuracy", "logps_chosen",
           "logps_rejected")


@dataclass
class Case:
    name: str
    recipe: str  # ddp, zero1, ...
    model: str  # the policy's folder
    objective: str = "dpo"
    mode: str = "auto"  # preference.reference_mode
    reference: str | None = None  # preference.reference (None: the policy's start)
    gas: int = 1
    lora: bool = False
    label_smoothing: float = 0.0
    extra: list = field(default_factory=list)  # more harness arguments


def side_logps(model, input_ids, labels):
    logits = model(input_ids=input_ids, use_cache=False).logits[:, :-1].float()
    target = labels[:, 1:]
    mask = target != -100
    tokens = torch.log_softmax(logits, -1).gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (tokens.double() * mask).sum(-1), mask.sum(-1).double()  # sums of ~100 nats: float64


def pair_loss(case: Case, pref: dict, pol, counts, ref):
    beta, half = pref["beta"], pol.shape[0] // 2
    pc, pr, nc, nr = pol[:half], pol[half:], counts[:half], counts[half:]
    if case.objective in ("dpo", "ipo"):
        hc, hr = pc - ref[:half], pr - ref[half:]
        if case.objective == "ipo":
            hc, hr = hc / nc, hr / nr
            loss = ((hc - hr - 1 / (2 * beta)) ** 2).mean()
        else:
            z, ls = beta * (hc - hr), case.label_smoothing
            loss = (-F.logsigmoid(z) * (1 - ls) - F.logsigmoid(-z) * ls).mean()
    else:
        hc, hr = pc / nc, pr / nr
        if case.objective == "simpo":
            loss = -F.logsigmoid(beta * (hc - hr) - pref["gamma"]).mean()
        else:  # orpo
            nll = -pc.sum() / nc.sum()
            odds = (hc - hr) - (torch.log(1 - torch.exp(hc)) - torch.log(1 - torch.exp(hr)))
            loss = nll - beta * F.logsigmoid(odds).mean()
    rc, rr = beta * hc.detach(), beta * hr.detach()
    return loss, {"rewards_chosen": rc.mean(), "rewards_rejected": rr.mean(), "rewards_margin": (rc - rr).mean(),
                  "rewards_accuracy": (rc > rr).float().mean(), "logps_chosen": pc.detach().mean(),
                  "logps_rejected": pr.detach().mean()}


def _models(case: Case, recipe: dict):
    from transformers import AutoModelForCausalLM

    load = lambda path: AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)  # noqa: E731
    policy = load(case.model).train()
    if case.lora:  # the same seeded adapters the launch attaches
        from harness.model import adapters

        adapters.apply(policy, {"adapter": recipe["adapter"], "train": {"seed": recipe["train"]["seed"]},
                                "activation_checkpointing": False})
    ref = None
    if case.objective in ("dpo", "ipo"):  # adapter mode: the base never changes, so the start's weights
        ref = load(case.reference or case.model).eval()
    return policy, ref


def _batch_loss(case, pref, policy, ref, pairs):
    input_ids, labels = pairs.tensors()
    pol, counts = side_logps(policy, input_ids, labels)
    with torch.no_grad():
        ref_logps = side_logps(ref, input_ids, labels)[0] if ref is not None else None
    return pair_loss(case, pref, pol, counts, ref_logps)


def expected(case: Case, recipe: dict, train, evals, steps: int, lr: float, ranks: int = 2) -> dict:
    """{"train": [{loss, grad_norm, metrics...} per step], "eval": {eval_loss, eval_<metric>} after the last}."""
    torch.manual_seed(0)
    pref, micro = recipe["preference"], recipe["batch"]["micro_batch_per_gpu"]
    policy, ref = _models(case, recipe)
    params = [p for p in policy.parameters() if p.requires_grad]
    out = {"train": []}
    for step in range(steps):
        parts, total = [], 0.0
        for rank in range(ranks):
            plan = BatchPlan(num_rows=train.shape[0], global_batch=micro * case.gas * ranks, micro_batch=micro,
                             grad_accum=case.gas, dp_rank=rank, dp_size=ranks, seed=recipe["train"]["seed"])
            for rows in plan.micro_batches(step):
                loss, metrics = _batch_loss(case, pref, policy, ref, train[rows])
                total = total + loss / (ranks * case.gas)
                parts.append({"loss": loss.detach(), **metrics})
        grads = torch.autograd.grad(total, params)
        record = {k: float(torch.stack([p[k] for p in parts]).mean()) for k in parts[0]}
        record["grad_norm"] = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads)))
        out["train"].append(record)
        with torch.no_grad():
            for p, g in zip(params, grads):
                p -= lr * g
    out["eval"] = _eval(case, pref, policy, ref, evals, recipe, ranks)
    return out


@torch.no_grad()
def _eval(case, pref, policy, ref, evals, recipe, ranks) -> dict:
    """As the trainer evaluates: rank r takes eval pairs r, r + dp, ... in micro-batches; means over both."""
    micro = recipe["batch"]["micro_batch_per_gpu"]
    per_rank = max(1, min(recipe["train"]["eval_batches"] * micro, evals.shape[0] // ranks))
    means = []
    for rank in range(ranks):
        rows = list(range(evals.shape[0]))[rank::ranks][:per_rank]
        parts = [_batch_loss(case, pref, policy, ref, evals[torch.tensor(rows[i:i + micro])])
                 for i in range(0, len(rows), micro)]
        means.append({"eval_loss": sum(float(p[0]) for p in parts) / len(parts),
                      **{f"eval_{k}": sum(float(p[1][k]) for p in parts) / len(parts) for k in METRICS}})
    return {k: sum(m[k] for m in means) / ranks for k in means[0]}
