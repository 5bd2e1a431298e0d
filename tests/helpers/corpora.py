"""Small instruction and chat corpora and a chat-template tokenizer, written into temp folders (no network)."""

from __future__ import annotations

import json
import random
from pathlib import Path

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
WORDS = "cat dog fish bird tree river stone cloud green blue red seven three small large quick slow".split()


def _phrase(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def write_instruction(path: Path, num: int, seed: int = 0, prompt="prompt", response="response") -> Path:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(num):
            q = _phrase(rng, rng.randint(3, 12))
            f.write(json.dumps({prompt: f"Repeat backwards: {q}\nAnswer:",
                                response: " " + " ".join(reversed(q.split()))}) + "\n")
    return path


def write_chat(path: Path, num: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(num):
            messages = [{"role": "system", "content": "You sort words."}]
            for _ in range(rng.randint(1, 2)):
                q = _phrase(rng, rng.randint(2, 8))
                messages += [{"role": "user", "content": q}, {"role": "assistant", "content": " ".join(sorted(q.split()))}]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def chat_tokenizer(template: str | None = CHAT_TEMPLATE):
    """The shipped tokenizer with a simple chat template (as a model folder's tokenizer would carry it)."""
    from harness.model.hf import load_tokenizer

    tok = load_tokenizer("tiny-llama")
    tok.chat_template = template
    return tok


def chat_model_dir(folder: Path, seed: int, template: str = CHAT_TEMPLATE) -> Path:
    """A tiny-llama model folder (weights from seed) whose tokenizer has `template` (CHAT_TEMPLATE by default)."""
    from harness.model.hf import build_model

    build_model("tiny-llama", seed=seed).save_pretrained(folder)
    chat_tokenizer(template).save_pretrained(folder)
    return folder
