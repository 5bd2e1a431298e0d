"""A step's rollouts on one rank, their micro-batch tensors, and RUN/rollouts.jsonl (written, and read back by
rl.replay).

A completion is kept as generated (`completion_ids`); what carries loss is its tokens up to and including the
first EOS (`kept`): the tokens after it are never fed to the model. A completion with no EOS was cut at
max_completion_length (finish "length"); under mask_truncated_completions none of its tokens carries loss.

rollouts.jsonl holds one line per completion of every generation, in the order of the step's completions (group
after group, num_generations each): step (the optimizer step, from 1, that generated it), group (the prompt's
index in the step), prompt_index (its record in the prompt set, when known), prompt_ids, completion_ids, finish
(eos | length), rewards ({function: score or null}), reward, advantage, and old_logps (per kept token) when they
are not the policy's own at the step (num_iterations > 1, or given by a replay file). Under rl.async a line also
has model_version (the policy version, optimizer steps done, whose weights sampled it: TRL's name),
sampling_logps (the generator's log-prob per kept token) and importance_ratios (per kept token, the ratio the
loss used: exp(logp - sampling_logp) under ppo_clip, the capped weight under tis).

A multi-turn rollout (rl.tools / rl.environment_factory, harness/rl/multiturn.py) records its whole conversation
after the prompt as completion_ids (each turn's sampled ids, each tool suffix between), with tool_mask (1 sampled,
0 tool tokens: TRL's), sampling_logps (the sampler's log-prob per sampled token, 0.0 on tool tokens), turns
([{ids, tool_calls, tool_results[, rolled_back]}]), tool_calls and tool_failures (counts), and finish (eos, length,
budget, max_iterations, error). All of it carries loss except the tool tokens (it ends at its last turn's EOS or at
the budget); a truncated one (no EOS at the end) carries none under mask_truncated_completions.

A distillation run's generated completions (harness/train/distill.py: gkd with lmbda > 0 or seq_kd, objective
distill) go to the same file, one line per generated row of a training step, in the step's row order: step, row (its
position in the step's global batch), prompt_index (its record), prompt_ids, completion_ids (as generated, before
the cut at train.seq_len), finish (eos | length) and source (student, or teacher under seq_kd); there are no rewards.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROLLOUTS_FILE = "rollouts.jsonl"


def first_eos(ids: list[int], eos_ids: tuple[int, ...]) -> int | None:
    for i, t in enumerate(ids):
        if t in eos_ids:
            return i
    return None


def kept_ids(ids: list[int], eos_ids: tuple[int, ...], tool_mask: list[int] | None = None) -> list[int]:
    """The ids fed to the model: up to and including the first EOS; a multi-turn rollout's whole (its turns end in
    EOS and go on after their tool results)."""
    if tool_mask is not None:
        return ids
    end = first_eos(ids, eos_ids)
    return ids if end is None else ids[:end + 1]


def truncated(ids: list[int], eos_ids: tuple[int, ...], tool_mask: list[int] | None = None) -> bool:
    """Cut at max_completion_length: no EOS (multi-turn: its last token is not EOS, TRL's rule)."""
    if tool_mask is not None:
        return not ids or ids[-1] not in eos_ids
    return first_eos(ids, eos_ids) is None


def loss_mask(kept: list[int], tool_mask: list[int] | None) -> list[int]:
    """1 per kept token that carries loss: every one, or the sampled ones (tool tokens 0)."""
    return [1] * len(kept) if tool_mask is None else list(tool_mask[:len(kept)])


@dataclass
class Rollouts:
    """This rank's completions of one generation, in step order (its contiguous slice of the step's)."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    advantages: torch.Tensor  # [n] float32
    eos_ids: tuple[int, ...]
    old_logps: list[torch.Tensor] | None = None  # per kept token; None: the policy's own (on-policy)
    ref_logps: list[torch.Tensor] | None = None  # per kept token; None: no reference (beta 0)
    extra: dict = field(default_factory=dict)  # what rollouts.jsonl records beside (rewards, finish, ...)
    tool_masks: list[list[int] | None] | None = None  # multi-turn: 0 on tool tokens; None: single-turn rows
    sampling_logps: list[torch.Tensor] | None = None  # rl.async: the generator's log-prob per kept token

    def tool_mask(self, i: int) -> list[int] | None:
        return None if self.tool_masks is None else self.tool_masks[i]

    def __len__(self) -> int:
        return len(self.completion_ids)

    def kept(self, i: int) -> list[int]:
        return kept_ids(self.completion_ids[i], self.eos_ids, self.tool_mask(i))

    def truncated(self, i: int) -> bool:
        return truncated(self.completion_ids[i], self.eos_ids, self.tool_mask(i))

    def loss_tokens(self, mask_truncated: bool) -> int:
        return sum(sum(loss_mask(self.kept(i), self.tool_mask(i))) for i in range(len(self))
                   if not (mask_truncated and self.truncated(i)))

    def tensors(self, rows: range, pad_id: int, mask_truncated: bool) -> dict:
        """input_ids [B, L] (prompt, kept completion, padding after), prompt_len [B], completion [B, C], mask [B, C]
        (float32), advantages [B], old / ref / sampling [B, C] or None."""
        kept = [self.kept(i) for i in rows]
        width = max(1, max(len(k) for k in kept))
        total = max(len(self.prompt_ids[i]) + len(k) for i, k in zip(rows, kept))
        input_ids = torch.full((len(rows), total), pad_id, dtype=torch.long)
        completion = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros(len(rows), width)
        for b, (i, k) in enumerate(zip(rows, kept)):
            p = self.prompt_ids[i]
            input_ids[b, :len(p) + len(k)] = torch.tensor(p + k, dtype=torch.long)
            completion[b, :len(k)] = torch.tensor(k, dtype=torch.long)
            if not (mask_truncated and self.truncated(i)):
                mask[b, :len(k)] = torch.tensor(loss_mask(k, self.tool_mask(i)), dtype=torch.float32)
        prompt_len = torch.tensor([len(self.prompt_ids[i]) for i in rows])
        return {"input_ids": input_ids, "prompt_len": prompt_len, "completion": completion, "mask": mask,
                "advantages": self.advantages[rows.start:rows.stop], "old": _padded(self.old_logps, rows, width),
                "ref": _padded(self.ref_logps, rows, width), "sampling": _padded(self.sampling_logps, rows, width)}


def _padded(values: list[torch.Tensor] | None, rows: range, width: int) -> torch.Tensor | None:
    if values is None:
        return None
    out = torch.zeros(len(rows), width, dtype=values[rows.start].dtype if len(rows) else torch.float32)
    for b, i in enumerate(rows):
        out[b, :len(values[i])] = values[i]
    return out


def lines(step: int, num_generations: int, rollouts: list[dict]) -> list[str]:
    """rollouts.jsonl lines of one generation: `rollouts` are the step's completions in order, each a dict with
    prompt_ids, completion_ids, finish, rewards, reward, advantage[, prompt_index, old_logps]; NaN (no function
    applied) is written as null."""
    return [json.dumps({"step": step, "group": j // num_generations, **_no_nan(r)}) for j, r in enumerate(rollouts)]


def _no_nan(value):
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, dict):
        return {k: _no_nan(v) for k, v in value.items()}
    return value


def append(run_dir: Path, new_lines: list[str]) -> None:
    """Rank 0: a generation's lines appended to RUN/rollouts.jsonl."""
    with open(Path(run_dir) / ROLLOUTS_FILE, "a") as out:
        out.write("".join(line + "\n" for line in new_lines))


def truncate_after(run_dir: Path, step: int) -> None:
    """Drop the lines of generations after `step` (a resumed run regenerates them)."""
    path = Path(run_dir) / ROLLOUTS_FILE
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
    path.write_text("".join(line + "\n" for line in keep))
