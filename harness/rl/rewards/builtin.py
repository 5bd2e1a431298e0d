"""Built-in rewards (an entry {"builtin": NAME, ...}), each a function with TRL's signature:

- exact_match: 1 when the completion, stripped, equals the record's `column` (default "answer"), stripped; else 0;
- regex: 1 when `pattern` is found in the completion (re.search, DOTALL); else 0;
- math: math-verify's parse + verify of the completion against the record's `column` (LaTeX, boxed, plain
  numbers; "1/2" equals "0.5"); 1 or 0;
- code: the completion's last ```python block (or all of it) followed by the record's `column` (default "tests":
  asserts) run in the sandbox (harness/rl/rewards/sandbox.py); 1 when it exits 0, else 0.

A record whose column is None (or missing) gets None: not applicable."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

from harness.rl.toy import completion_text

NAMES = ("exact_match", "regex", "math", "code")
DEFAULT_COLUMN = {"exact_match": "answer", "math": "answer", "code": "tests"}
CODE_BLOCK = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)


def exact_match(column: str):
    def exact_match(prompts, completions, **kwargs):
        answers = kwargs.get(column) or [None] * len(completions)
        return [None if a is None else float(completion_text(c).strip() == str(a).strip())
                for c, a in zip(completions, answers)]
    return exact_match


def regex(pattern: str):
    compiled = re.compile(pattern, re.DOTALL)

    def regex(prompts, completions, **kwargs):
        return [float(compiled.search(completion_text(c)) is not None) for c in completions]
    return regex


def math(column: str):
    from math_verify import parse, verify

    def math(prompts, completions, **kwargs):
        answers = kwargs.get(column) or [None] * len(completions)
        out = []
        for completion, answer in zip(completions, answers):
            if answer is None:
                out.append(None)
                continue
            gold, guess = parse(str(answer)), parse(completion_text(completion))
            out.append(float(bool(gold) and bool(guess) and verify(gold, guess)))
        return out
    return math


def program(completion: str, tests: str) -> str:
    blocks = CODE_BLOCK.findall(completion)
    return (blocks[-1] if blocks else completion) + "\n\n" + tests + "\n"


def code(column: str, limits: dict, concurrency: int):
    from harness.rl.rewards import sandbox

    def code(prompts, completions, **kwargs):
        tests = kwargs.get(column) or [None] * len(completions)

        def one(pair):
            completion, test = pair
            if test is None:
                return None
            return float(sandbox.run(program(completion_text(completion), str(test)), limits=limits).ok)

        with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
            return list(pool.map(one, zip(completions, tests)))
    return code


def make(entry: dict, sandbox_limits: dict):
    """The built-in function an entry names (its name, its callable)."""
    name = entry["builtin"]
    column = entry.get("column") or DEFAULT_COLUMN.get(name, "")
    if name == "exact_match":
        return exact_match(column)
    if name == "regex":
        return regex(entry["pattern"])
    if name == "math":
        return math(column)
    return code(column, sandbox_limits, int(sandbox_limits.get("concurrency", 2)))
