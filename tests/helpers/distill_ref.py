"""A plain-torch GKD step, written from issue 45's formulas (TRL's generalised JSD), the parity reference of the
distillation tests: one process, HF models, the rows each rank of a launch takes (the harness's BatchPlan over the
same prompt-completion rows), the loss over every loss token of the step divided by their number, SGD (p -= lr x
grad) with no clipping. It does not call the harness's loss, step or teacher code. Also the tests' tiny
prompt-completion set and a sharpened teacher folder."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from harness.data.batches import BatchPlan
from helpers.preference_ref import WORDS



def write_completions(path: Path, count: int = 13, seed: int = 3) -> Path:
    """Prompt-completion records whose completions differ in length, so ranks get unequal token counts."""
    rng = random.Random(seed)
    phrase = lambda lo, hi: " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))  # noqa: E731
    with open(path, "w") as f:
        for _ in range(count):
            f.write(json.dumps({"prompt": phrase(2, 5), "completion": " " + phrase(1, 9)}) + "\n")
    return Path(path)


def sharpened_folder(source, path, scale: float = 6.0) -> str:
    """A copy of a model folder with its output head scaled: a peaked teacher, far from a random student."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source, torch_dtype=torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(scale)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(source).save_pretrained(path)
    return str(path)


@dataclass
class Case:
    name: str
    recipe: str  # ddp, zero2, zero3, ...
    beta: float
    loss_temperature: float | None = None  # None: TRL's gkd, T = 1 in the loss
    gas: int = 1
    ce_alpha: float = 0.0
    lora: bool = False  # teacher mode adapter: the student's base with the adapters off


def jsd_sums(student_logits, teacher_logits, labels, beta: float, temp: float, ce_alpha: float):
    """(loss sum, student entropy sum, teacher entropy sum, loss tokens) of [B, L, V] logits, from the formulas, in
    float64."""
    target = labels[:, 1:]
    mask = target != -100
    s, t = student_logits[:, :-1][mask].double(), teacher_logits[:, :-1][mask].double()
    log_s, log_t = torch.log_softmax(s / temp, -1), torch.log_softmax(t / temp, -1)
    p_s, p_t = log_s.exp(), log_t.exp()
    if beta == 0:
        per_token = (p_t * (log_t - log_s)).sum(-1)
    elif beta == 1:
        per_token = (p_s * (log_s - log_t)).sum(-1)
    else:
        log_m = torch.log((1 - beta) * p_s + beta * p_t)
        per_token = beta * (p_t * (log_t - log_m)).sum(-1) + (1 - beta) * (p_s * (log_s - log_m)).sum(-1)
    loss = per_token.sum()
    if ce_alpha:
        loss = loss - ce_alpha * torch.log_softmax(s, -1).gather(-1, target[mask].unsqueeze(-1)).sum()
    entropy = lambda p, log_p: -(p * log_p).sum()  # noqa: E731
    return loss, entropy(p_s, log_s).detach(), entropy(p_t, log_t), int(mask.sum())


def _models(case: Case, recipe: dict, student: str, teacher: str):
    from transformers import AutoModelForCausalLM

    load = lambda path: AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)  # noqa: E731
    model = load(student).train()
    if case.lora:  # the same seeded adapters the launch attaches; the teacher is the base, which never changes
        from harness.model import adapters

        adapters.apply(model, {"adapter": recipe["adapter"], "train": {"seed": recipe["train"]["seed"]},
                               "activation_checkpointing": False})
        return model, load(student).eval()
    return model, load(teacher).eval()


def _sums(case, model, teacher, rows):
    input_ids, labels, _ = rows.tensors()
    with torch.no_grad():
        t = teacher(input_ids=input_ids, use_cache=False).logits
    s = model(input_ids=input_ids, use_cache=False).logits
    return jsd_sums(s, t, labels, case.beta, case.loss_temperature or 1.0, case.ce_alpha)


def expected(case: Case, recipe: dict, student: str, teacher: str, train, evals, steps: int, lr: float,
             ranks: int = 2) -> dict:
    """{"train": [{loss, grad_norm, entropy, teacher_entropy} per step], "eval": {...} after the last, "model"}."""
    torch.manual_seed(0)
    micro = recipe["batch"]["micro_batch_per_gpu"]
    model, teach = _models(case, recipe, student, teacher)
    params = [p for p in model.parameters() if p.requires_grad]
    out = {"train": []}
    for step in range(steps):
        sums = [0.0, 0.0, 0.0, 0]
        for rank in range(ranks):
            plan = BatchPlan(num_rows=train.shape[0], global_batch=micro * case.gas * ranks, micro_batch=micro,
                             grad_accum=case.gas, dp_rank=rank, dp_size=ranks, seed=recipe["train"]["seed"])
            for rows in plan.micro_batches(step):
                sums = [a + b for a, b in zip(sums, _sums(case, model, teach, train[rows]))]
        loss = sums[0] / sums[3]
        grads = torch.autograd.grad(loss, params)
        out["train"].append({"loss": float(loss.detach()), "entropy": float(sums[1]) / sums[3],
                             "teacher_entropy": float(sums[2]) / sums[3], "tokens": sums[3],
                             "grad_norm": float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads)))})
        with torch.no_grad():
            for p, g in zip(params, grads):
                p -= lr * g.to(p.dtype)
    out["eval"] = _eval(case, model, teach, evals, recipe, ranks)
    out["model"] = model
    return out


@torch.no_grad()
def _eval(case, model, teacher, evals, recipe, ranks) -> dict:
    """As the trainer evaluates: rank r takes eval rows r, r + dp, ...; each rank's sum / its tokens, then the mean."""
    micro = recipe["batch"]["micro_batch_per_gpu"]
    per_rank = max(1, min(recipe["train"]["eval_batches"] * micro, evals.shape[0] // ranks))
    model.eval()
    means = []
    for rank in range(ranks):
        rows = list(range(evals.shape[0]))[rank::ranks][:per_rank]
        parts = [_sums(case, model, teacher, evals[torch.tensor(rows[i:i + micro])]) for i in range(0, len(rows), micro)]
        count = sum(p[3] for p in parts)
        means.append({"eval_loss": float(sum(p[0] for p in parts)) / count,
                      "eval_entropy": float(sum(p[1] for p in parts)) / count,
                      "eval_teacher_entropy": float(sum(p[2] for p in parts)) / count})
    model.train()
    return {k: sum(m[k] for m in means) / ranks for k in means[0]}
