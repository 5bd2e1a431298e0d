"""The built-in verifiable task (train.objective grpo with train.dataset builtin): reply in vowels.

Each record's prompt asks for a reply made of the letters in its `letters` column ("aeiou"); the reward is the share
of the completion's characters that are among them (TRL's reward signature: the column arrives as a keyword). The
built-in tiny model, untrained, samples its 512 tokens about evenly and scores ~0.23; a model that learned the task
puts its mass on tokens such as 'e', 'a', 'oo' and scores near 1. It needs no network, no weights and no tokenizer
of its own, and learns on CPU in a few dozen steps (tests/test_rl_learning.py, bench/rl.py).
"""

from __future__ import annotations

import random

LETTERS = "aeiou"
REWARD = "harness.rl.toy:vowels"  # the reward entry of train.dataset builtin when rl.rewards is empty
WORDS = ("sun", "tree", "river", "stone", "cloud", "bird", "lamp", "road", "hill", "leaf", "rain", "star", "boat",
         "door", "seed", "wind")


def records(count: int = 256, seed: int = 0) -> list[dict]:
    """`count` prompts: {"prompt": text, "letters": LETTERS}, deterministic in seed."""
    rng = random.Random(seed)
    return [{"prompt": f"Reply in vowels about the {rng.choice(WORDS)} and the {rng.choice(WORDS)}:",
             "letters": LETTERS} for _ in range(count)]


def completion_text(completion) -> str:
    """A completion as TRL passes it: text, or a list of messages (conversational prompts)."""
    if isinstance(completion, list):
        return "".join(m.get("content", "") for m in completion if isinstance(m, dict))
    return completion


def vowels(prompts, completions, completion_ids=None, letters=None, **kwargs) -> list[float]:
    """The share of each completion's characters that are in its record's `letters` (0 for an empty one)."""
    letters = letters or [LETTERS] * len(completions)
    out = []
    for completion, allowed in zip(completions, letters):
        text = completion_text(completion)
        out.append(sum(c in allowed for c in text) / len(text) if text else 0.0)
    return out
