"""A plain-torch GRPO written from the formulas of issue 38 (TRL 1.16's GRPOTrainer), one completion at a time, to
check harness/rl + harness/train/grpo.py against: the fixed batch a replay file feeds, the advantages, the
per-token loss of every loss_type, the KL, and each loss's averaging over micro-batches and ranks.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

EOS = 0
PROMPTS = ([33, 68, 68, 349, 284], [415, 26, 101], [77, 78, 79, 80])
MAX_COMPLETION = 6
# per group: completions as generated (EOS = 0; tokens after it are junk), and rewards
COMPLETIONS = (
    ([[40, 41, 0, 99, 98], [42, 0], [43, 44, 45, 46, 47, 48], [50, 51, 52, 0, 7, 7]], [1.0, 0.5, 0.0, 2.0]),
    ([[60, 0], [61, 62, 0], [63, 0, 5], [64, 65, 66, 0]], [1.0, 1.0, 1.0, 1.0]),  # zero std
    ([[70, 71, 72, 73, 74, 0], [0], [75, 0, 1, 2], [76, 77, 0]], [0.0, 3.0, 1.5, 0.25]),
)


# multi-turn (tool use): per group, completions as [(ids, sampled?)...] spans: a turn ends in EOS, tool suffix ids
# (not sampled: tool_mask 0) follow, the next turn after them; some end truncated (no EOS at the end)
T, S = True, False
TOOL_COMPLETIONS = (
    ([[([40, 41, 0], T), ([90, 91, 92], S), ([43, 0], T)], [([42, 0], T)],
      [([44, 0], T), ([93, 94], S), ([45, 46, 47], T)],
      [([50, 0], T), ([95], S), ([51, 0], T), ([96, 97], S), ([52, 0], T)]],
     [1.0, 0.0, 0.5, 2.0]),
    ([[([60, 61, 0], T), ([98, 99], S), ([62, 0], T)], [([63, 64, 65, 66], T)], [([67, 0], T)],
      [([68, 0], T), ([100, 101, 102], S), ([69, 0], T)]], [1.0, 0.0, 0.0, 1.0]),
    ([[([70, 0], T)], [([71, 72, 0], T), ([103], S), ([73, 0], T)], [([74, 0], T), ([104, 105], S), ([75], T)],
      [([76, 77, 78, 0], T)]], [0.0, 3.0, 1.5, 0.25]),
)


def tool_records(unmasked: bool = False) -> list[dict]:
    """The multi-turn batch as rollouts.jsonl lines: completion_ids with tool_mask (all 1 when unmasked: the tool
    tokens trained as if sampled, the bug the mask prevents)."""
    out = []
    for g, (prompt, (comps, rewards)) in enumerate(zip(PROMPTS, TOOL_COMPLETIONS)):
        for spans, r in zip(comps, rewards):
            ids = [t for span, _ in spans for t in span]
            mask = [1 if (sampled or unmasked) else 0 for span, sampled in spans for _ in span]
            out.append({"group": g, "prompt_ids": list(prompt), "completion_ids": ids, "tool_mask": mask,
                        "reward": r})
    return out


@dataclass
class Case:
    name: str
    recipe: str
    rl: dict = field(default_factory=dict)
    old_shift: float | None = None  # old_logps recorded = the policy's + a seeded perturbation of this size
    lora: bool = False
    reference: str | None = None  # a model folder (beta > 0)


def records(old: list[list[float]] | None = None) -> list[dict]:
    out = []
    for g, (prompt, (comps, rewards)) in enumerate(zip(PROMPTS, COMPLETIONS)):
        for c, r in zip(comps, rewards):
            out.append({"group": g, "prompt_ids": list(prompt), "completion_ids": list(c), "reward": r})
    if old is not None:
        for r, o in zip(out, old):
            r["old_logps"] = o
    return out


def kept(ids: list[int], tool_mask: list[int] | None = None) -> list[int]:
    if tool_mask is not None:  # multi-turn: the whole conversation after the prompt
        return ids
    return ids[:ids.index(EOS) + 1] if EOS in ids else ids


def is_truncated(record: dict) -> bool:
    ids = record["completion_ids"]
    return ids[-1] != EOS if "tool_mask" in record else EOS not in ids


def loss_weights(record: dict) -> torch.Tensor:
    """1 per kept token that carries loss (tool tokens 0)."""
    comp = kept(record["completion_ids"], record.get("tool_mask"))
    return torch.tensor(record.get("tool_mask", [1] * len(comp)), dtype=torch.float32)


def write_replay(path: Path, steps: int, old: list[list[float]] | None = None, rows: list[dict] | None = None) -> Path:
    lines = [json.dumps({"step": s, **r}) for s in range(1, steps + 1) for r in (rows or records(old))]
    Path(path).write_text("\n".join(lines) + "\n")
    return Path(path)


def advantages(rewards: list[float], g: int, scale: str) -> list[float]:
    out = []
    everything = torch.tensor(rewards, dtype=torch.float32)
    for i in range(0, len(rewards), g):
        group = everything[i:i + g]
        std = group.std() if scale != "batch" else everything.std()  # Bessel-corrected
        for x in group:
            a = x - group.mean()
            out.append(float(a / (std + 1e-4)) if scale != "none" else float(a))
    return out


def token_logps(model, prompt: list[int], comp: list[int], temperature: float) -> torch.Tensor:
    ids = torch.tensor([prompt + comp])
    logits = model(input_ids=ids).logits[0].float() / temperature
    logp = torch.log_softmax(logits[len(prompt) - 1:len(prompt) - 1 + len(comp)], dim=-1)
    return logp[torch.arange(len(comp)), torch.tensor(comp)]


def seq_loss(model, ref_model, record: dict, adv: float, rl: dict) -> tuple[torch.Tensor, int]:
    """(summed per-token loss of one completion, its loss tokens) by the formulas."""
    comp = kept(record["completion_ids"], record.get("tool_mask"))
    if rl.get("mask_truncated_completions") and is_truncated(record):
        return torch.zeros(()), 0
    weights = loss_weights(record)
    t = rl.get("temperature", 1.0)
    logp = token_logps(model, record["prompt_ids"], comp, t)
    old = torch.tensor(record["old_logps"]) if "old_logps" in record else logp.detach()
    if rl.get("importance_sampling_level") == "sequence":
        ratio = torch.exp(((logp - old) * weights).sum() / weights.sum()).expand(len(comp))
    else:
        ratio = torch.exp(logp - old)
    eps = rl.get("epsilon", 0.2)
    eps_high = rl.get("epsilon_high") or eps
    kind = rl.get("loss_type", "dapo")
    if kind == "cispo":
        per = -torch.clamp(ratio, max=eps_high).detach() * adv * logp
    elif kind == "sapo":
        tau = 1.0 if adv > 0 else 1.05
        per = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * adv
    else:
        free = ratio if rl.get("delta") is None else torch.clamp(ratio, max=rl["delta"])
        per = -torch.minimum(free * adv, torch.clamp(ratio, 1 - eps, 1 + eps_high) * adv)
    if rl.get("beta", 0.0):
        with torch.no_grad():
            ref = token_logps(ref_model, record["prompt_ids"], comp, t)
        per = per + rl["beta"] * (torch.exp(ref - logp) - (ref - logp) - 1) * ratio
    return (per * weights).sum(), int(weights.sum())


def micro_loss(model, ref_model, rows: list[dict], advs: list[float], rl: dict, step_tokens: int,
               splits: int) -> torch.Tensor:
    parts = [seq_loss(model, ref_model, r, a, rl) for r, a in zip(rows, advs)]
    kind = rl.get("loss_type", "dapo")
    if kind in ("grpo", "sapo"):
        return sum(s / max(n, 1) for s, n in parts) / len(parts)
    if kind == "bnpo":
        return sum(s for s, _ in parts) / max(sum(n for _, n in parts), 1)
    if kind == "dr_grpo":
        return sum(s for s, _ in parts) / (len(parts) * rl.get("max_completion_length", MAX_COMPLETION))
    return sum(s for s, _ in parts) * splits / step_tokens  # dapo, cispo


def step_loss(model, ref_model, rows: list[dict], rl: dict, micro: int, gas: int, world: int) -> torch.Tensor:
    """The mean over ranks and micro-batches of the micro-batch losses (what the engine's update differentiates)."""
    advs = advantages([r["reward"] for r in rows], rl.get("num_generations", 4), rl.get("scale_rewards", "group"))
    mask_trunc = rl.get("mask_truncated_completions")
    tokens = sum(int(loss_weights(r).sum()) for r in rows if not (mask_trunc and is_truncated(r)))
    per_rank, losses = micro * gas, []
    for rank in range(world):
        for m in range(gas):
            lo = rank * per_rank + m * micro
            losses.append(micro_loss(model, ref_model, rows[lo:lo + micro], advs[lo:lo + micro], rl, tokens,
                                     world * gas))
    return sum(losses) / len(losses)


def clip_fractions(model, record: dict, adv: float, rl: dict) -> tuple[float, float, int] | None:
    """(low-clipped, high-clipped tokens, loss tokens) of one completion (a GSPO completion counts as one token), or
    None for cispo / sapo; for cispo the high count is cispo's (r > epsilon_high, A > 0)."""
    kind = rl.get("loss_type", "dapo")
    if kind == "sapo":
        return None
    comp = kept(record["completion_ids"], record.get("tool_mask"))
    masked = rl.get("mask_truncated_completions") and is_truncated(record)
    with torch.no_grad():
        logp = token_logps(model, record["prompt_ids"], comp, rl.get("temperature", 1.0))
    old = torch.tensor(record["old_logps"]) if "old_logps" in record else logp
    loss_tokens = loss_weights(record).bool()  # tool tokens carry no loss and count in no metric
    if rl.get("importance_sampling_level") == "sequence":  # masked: a log-ratio of 0 (r = 1), still one completion
        ratios = [1.0 if masked else math.exp(float((logp - old)[loss_tokens].mean()))]
    else:
        ratios = [] if masked else [math.exp(float(x)) for x in (logp - old)[loss_tokens]]
    eps = rl.get("epsilon", 0.2)
    eps_high = rl.get("epsilon_high") or eps
    if kind == "cispo":
        return 0, sum(r > eps_high and adv > 0 for r in ratios), len(ratios)
    return (sum(r < 1 - eps and adv < 0 for r in ratios), sum(r > 1 + eps_high and adv > 0 for r in ratios),
            len(ratios))


def clip_metrics(model, rows: list[dict], rl: dict, micro: int, gas: int, world: int) -> dict:
    """TRL's clip metrics of one step: per micro-batch index m (rank r's m-th micro-batch on every rank), the token
    fractions over every rank's tokens and the least / most clipped completion of any rank; then the mean over m."""
    advs = advantages([r["reward"] for r in rows], rl.get("num_generations", 4), rl.get("scale_rewards", "group"))
    per_m = []
    for m in range(gas):
        counts = [clip_fractions(model, rows[i], advs[i], rl)
                  for r in range(world) for i in range(r * micro * gas + m * micro, r * micro * gas + (m + 1) * micro)]
        if counts[0] is None:
            return {}
        low, high, n = (sum(c[k] for c in counts) for k in range(3))
        if rl.get("loss_type") == "cispo":
            per_m.append({"cispo_clip_ratio": high / max(n, 1)})
            continue
        lows, highs = [c[0] / c[2] for c in counts if c[2]], [c[1] / c[2] for c in counts if c[2]]
        region = sum(c[0] + c[1] for c in counts)  # low and high never both hold for one token
        per_m.append({"clip_ratio/low_mean": low / max(n, 1), "clip_ratio/high_mean": high / max(n, 1),
                      "clip_ratio/region_mean": region / max(n, 1), "clip_ratio/low_min": min(lows),
                      "clip_ratio/high_max": max(highs)})
    return {k: sum(d[k] for d in per_m) / len(per_m) for k in per_m[0]}


def expected(model_folder: str, rows: list[dict], rl: dict, micro: int, gas: int, world: int, lr: float,
             steps: int = 2, reference: str | None = None, metric_split: tuple[int, int, int] | None = None) -> list[dict]:
    """Per step: the loss and the grad norm (and the clip metrics of the run split micro x gas x world as
    metric_split, when given: they depend on the split), then one SGD step of lr (no clipping)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_folder, torch_dtype=torch.float32)
    ref_model = AutoModelForCausalLM.from_pretrained(reference or model_folder, torch_dtype=torch.float32)
    out = []
    for _ in range(steps):
        model.zero_grad()
        loss = step_loss(model, ref_model, rows, rl, micro, gas, world)
        loss.backward()
        norm = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in model.parameters() if p.grad is not None))
        out.append({"loss": float(loss.detach()), "grad_norm": norm,
                    **(clip_metrics(model, rows, rl, *metric_split) if metric_split else {})})
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= lr * p.grad
    return out


def close(name: str, got, want, tol: float) -> float:
    """|got - want| of a logged metric, asserted within tol (relative above 1)."""
    assert got is not None, f"{name} not logged (want {want})"
    err = abs(got - want)
    assert err <= tol * max(1.0, abs(want)), f"{name}: {got} vs {want} (error {err:.2g})"
    return err


def perturbed_old(model_folder: str, shift: float, temperature: float = 1.0, seed: int = 7,
                  rows: list[dict] | None = None) -> list[list[float]]:
    """The policy's own per-token log-probs of each kept completion, moved by seeded noise of size `shift`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_folder, torch_dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    out = []
    with torch.no_grad():
        for r in rows or records():
            logp = token_logps(model, r["prompt_ids"], kept(r["completion_ids"], r.get("tool_mask")), temperature)
            out.append((logp + shift * torch.randn(logp.shape, generator=gen)).tolist())
    return out
