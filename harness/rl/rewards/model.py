"""A reward model (an entry {"model": FOLDER_OR_HUB_ID, ...}): transformers' sequence-classification model with one
label (what `train.objective=reward` exports), frozen, scoring prompt + completion as TRL does (the texts joined;
a conversation through the reward tokenizer's chat template), the logit of label 0 as the reward.

Under a ZeRO-3 policy (ds_config given) it is built under zero.Init and wrapped by deepspeed.initialize with no
optimizer, so each rank holds 1/N of it, as a reference engine (its forwards are then collective: every rank scores
the same number of batches, which the RL step's equal shares give). Otherwise each rank holds a whole copy.

Its tokenizer must be the policy's (the same vocabulary), or the entry says `"tokenizer": "own"` to score the
decoded text with the reward model's own tokenizer."""

from __future__ import annotations

import torch

from harness.errors import UsageError

BATCH = 16  # sequences per forward


def frozen_config(ds: dict) -> dict:
    """The reward engine's DeepSpeed dict: the policy's precision and ZeRO-3 parameter sharding, no optimizer."""
    zero = ds.get("zero_optimization", {})
    out = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10**9}
    for key in ("bf16", "fp16"):
        if ds.get(key, {}).get("enabled"):
            out[key] = {"enabled": True}
    out["zero_optimization"] = {k: v for k, v in zero.items() if k.startswith("stage3_") or
                                k in ("stage", "offload_param")} if zero.get("stage") == 3 else {"stage": 0}
    return out


def _load(spec: str, where: str, zero3: dict | None):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from harness.model.hf import _zero3_context

    try:
        tokenizer = AutoTokenizer.from_pretrained(spec)
        with _zero3_context(zero3):
            model = AutoModelForSequenceClassification.from_pretrained(spec, num_labels=1)
    except (OSError, ValueError) as err:
        raise UsageError(f"{where}: reward model {spec!r} does not load as a sequence-classification model with "
                         f"one label ({err})\n    fix: a folder exported by a train.objective=reward run, or an "
                         "AutoModelForSequenceClassification checkpoint") from None
    return model, tokenizer


def reward_model(entry: dict, *, policy_tokenizer, where: str, ds_config: dict | None = None):
    spec = entry["model"]
    zero3 = frozen_config(ds_config) if ds_config and ds_config.get("zero_optimization", {}).get("stage") == 3 \
        else None
    model, tokenizer = _load(spec, where, zero3)
    if entry.get("tokenizer", "policy") != "own" and policy_tokenizer is not None and \
            tokenizer.get_vocab() != policy_tokenizer.get_vocab():
        raise UsageError(f"{where}: reward model {spec!r} has another tokenizer ({len(tokenizer)} tokens) than the "
                         f"policy ({len(policy_tokenizer)} tokens)\n    fix: train the reward model from the "
                         "policy's model family, or set \"tokenizer\": \"own\" to score the decoded text with its own")
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    forward = model
    if ds_config is not None:
        import deepspeed

        forward = deepspeed.initialize(model=model, config=frozen_config(ds_config))[0]
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = tokenizer.pad_token_id

    @torch.no_grad()
    def score(prompts, completions, **kwargs):
        texts = [_text(tokenizer, p, c) for p, c in zip(prompts, completions)]
        out = []
        for start in range(0, max(len(texts), 1), BATCH):
            chunk = texts[start:start + BATCH] or [""]
            enc = tokenizer(chunk, padding=True, padding_side="right", add_special_tokens=False,
                            return_tensors="pt")
            logits = forward(input_ids=enc["input_ids"].to(_device(model)),
                             attention_mask=enc["attention_mask"].to(_device(model))).logits
            out += logits[:, 0].float().tolist()[:len(texts[start:start + BATCH])]
        return out
    score.__name__ = "reward_model"
    return score


def _device(model):
    return next(model.parameters()).device


def _text(tokenizer, prompt, completion) -> str:
    if isinstance(prompt, list):  # conversational, as TRL: the chat template over prompt + completion messages
        return tokenizer.apply_chat_template(prompt + completion, tokenize=False)
    return prompt + completion
