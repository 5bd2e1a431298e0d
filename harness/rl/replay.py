"""rl.replay=FILE: train from recorded rollouts instead of generating (no generator and no reward runs).

The file is a run's rollouts.jsonl or one written by hand in its fields (harness/rl/rollouts.py). Per line:
step (the optimizer step, from 1, whose generation it is: 1, 1 + num_iterations, ...), prompt_ids and
completion_ids (lists of token ids; tokens after the first EOS carry no loss), and either advantage (used as
recorded) or reward (advantages computed from the step's rewards as the run would: rl.scale_rewards); old_logps
(one per kept completion token) are used as recorded when given. A multi-turn line (harness/rl/multiturn.py) adds
tool_mask (0/1 per completion token: the tool tokens carry no loss) and trains with no tool or environment run; its
turns and sampling_logps are records only. A step's lines are its completions in order,
num_generations per prompt. Checked whole before any rank trains (harness/train/checks.py): exit 2 naming the
file, the line and the fix.
"""

from __future__ import annotations

import json
from pathlib import Path

from harness.errors import UsageError
from harness.rl.rollouts import kept_ids

FIX = ("fix: write one JSON object per line with step, prompt_ids, completion_ids and advantage (or reward); "
       "docs/rl.md describes the fields")


def _problem(path: Path, number: int | None, what: str) -> UsageError:
    where = f"{path}:{number}" if number is not None else str(path)
    return UsageError(f"rl.replay {where}: {what}\n    {FIX}")


def _ids(value) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)


def _check_line(path: Path, number: int, record, eos_ids: tuple[int, ...]) -> None:
    if not isinstance(record, dict):
        raise _problem(path, number, f"a {type(record).__name__}, not an object")
    if not isinstance(record.get("step"), int) or record["step"] < 1:
        raise _problem(path, number, f"step {record.get('step')!r} is not a step number (1, 2, ...)")
    for key in ("prompt_ids", "completion_ids"):
        if not _ids(record.get(key)) or not record.get(key):
            raise _problem(path, number, f"{key} is not a non-empty list of token ids: {str(record.get(key))[:80]}")
    if not any(isinstance(record.get(k), (int, float)) for k in ("advantage", "reward")):
        raise _problem(path, number, "neither advantage nor reward is a number")
    mask = record.get("tool_mask")
    if mask is not None and (not isinstance(mask, list) or len(mask) != len(record["completion_ids"]) or
                             any(m not in (0, 1) or isinstance(m, bool) for m in mask)):
        count = len(record["completion_ids"])
        raise _problem(path, number, f"tool_mask is not one 0 or 1 per completion token ({count}): {str(mask)[:80]}")
    old = record.get("old_logps")
    if old is not None:
        kept = len(kept_ids(record["completion_ids"], eos_ids, mask))
        if not isinstance(old, list) or len(old) != kept:
            raise _problem(path, number, f"old_logps holds {len(old) if isinstance(old, list) else old!r} values "
                                         f"for {kept} completion tokens up to the first EOS")


def read(path: str | Path, eos_ids: tuple[int, ...]) -> dict[int, list[dict]]:
    """{step: its records in file order}, every line checked."""
    path = Path(path)
    if not path.is_file():
        raise _problem(path, None, "no such file")
    steps: dict[int, list[dict]] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise _problem(path, number, f"not JSON ({e.msg}): {line[:80]}") from None
        _check_line(path, number, record, eos_ids)
        steps.setdefault(record["step"], []).append(record)
    return steps


def check(steps: dict[int, list[dict]], path, *, total_steps: int, num_iterations: int, completions: int,
          num_generations: int) -> None:
    """Every generation the run makes has exactly its completions, in groups that share their prompt."""
    for step in range(1, total_steps + 1, num_iterations):
        got = steps.get(step, [])
        if len(got) != completions:
            raise _problem(Path(path), None, f"step {step} has {len(got)} completions; the run generates "
                           f"{completions} per generation (the global batch) at steps 1, {1 + num_iterations}, ... "
                           f"up to train.steps {total_steps}")
        for g in range(0, completions, num_generations):
            if len({tuple(r["prompt_ids"]) for r in got[g:g + num_generations]}) != 1:
                raise _problem(Path(path), None, f"step {step}: completions {g}..{g + num_generations - 1} (group "
                               f"{g // num_generations}) do not share one prompt_ids; a group is num_generations "
                               f"({num_generations}) consecutive lines of one prompt")
