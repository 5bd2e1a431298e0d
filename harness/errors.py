"""Errors that teach: every user-facing problem names where, what, and how to fix it.

`Problem` is one finding (a JSON path, what is wrong with which values, the fix). `ConfigError`
carries every problem found in one pass, so a user fixes them all at once. The CLI maps
`ConfigError` and `UsageError` to exit code 2 with no traceback.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|API_KEY|ACCESS_KEY", re.IGNORECASE)


@dataclass(frozen=True)
class Problem:
    path: str  # dotted JSON path, "zero_optimization.offload_param.device"; "" for the whole file
    message: str  # what is wrong, with the values involved
    fix: str = ""  # what to change
    severity: str = "error"  # "error" or "warning"

    def render(self, source: str = "") -> str:
        where = ":".join(p for p in (source, self.path or "<root>") if p)
        text = f"{where}: {self.message}"
        if self.fix:
            text += f"\n    fix: {self.fix}"
        return text


class UsageError(Exception):
    """Bad command-line input (unknown recipe, malformed --set, missing file). Exit code 2."""


class RunComplete(Exception):
    """A resumed run whose checkpoint is already at (or past) train.steps: nothing to train, nothing is written.
    Exit code 0, so `harness launch --max-restarts` and a requeued Slurm job end as done, not failed."""


class GeneratorFailed(RuntimeError):
    """rl.async's generator process died, raised or went silent (harness/rl/async_rollouts.py): every rank raises
    it with the same reason after the step's gather (rank 0 says it, the others print it); harness/train/job.py
    ends the run with exit_code."""

    exit_code = 1


class ConfigError(Exception):
    """One or more configuration problems. Exit code 2."""

    def __init__(self, problems: list[Problem], source: str = ""):
        self.problems = [p for p in problems if p.severity == "error"]
        self.source = source
        super().__init__(self.render())

    def render(self) -> str:
        n = len(self.problems)
        head = f"{self.source or 'config'}: {n} problem{'s' if n != 1 else ''}"
        return "\n".join([head] + ["  " + p.render() for p in self.problems])


def raise_if_errors(problems: list[Problem], source: str = "") -> list[Problem]:
    """Raise ConfigError when any problem is an error; return the warnings otherwise."""
    if any(p.severity == "error" for p in problems):
        raise ConfigError(problems, source)
    return [p for p in problems if p.severity == "warning"]


def without_secrets(text: str) -> str:
    """`text` with the value of every secret-looking environment variable (HF_TOKEN, WANDB_API_KEY, ...) masked:
    a message may quote a library's error, and that error a URL or header holding the token."""
    for name, value in os.environ.items():
        if SECRET_NAME.search(name) and len(value) >= 8:
            text = text.replace(value, f"<${name}>")
    return text
