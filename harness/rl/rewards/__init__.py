"""Rewards (`rl.rewards`): a list of entries, each a string "module:function" / "file.py:function" or an object
with exactly one of function | verifier | model | builtin, and an optional weight (default 1) and name.

The contract with the RL step (harness/train/grpo.py):
- `load_rewards(rl, *, tokenizer, base_dir, ds_config=None) -> RewardSet`; a bad entry raises UsageError (exit 2)
  naming rl.rewards[i], the module or file, the function, and the fix;
- `RewardSet.names`, `.weights`; `.score(prompts=, completions=, completion_ids=, columns=)` ->
  [n_completions][n_functions] floats or None (not applicable).

A function that raises is called again sample by sample to find the sample; then rl.reward_errors decides: stop
(RewardError, naming the function, the sample's index, its prompt and completion, and the exception) or zero (that
sample scores 0; counted in `.errors`). A verifier that gives no rewards after its retries: stop, or 0 for its
batch. With no entries and train.dataset builtin, the built-in toy task's reward (harness/rl/toy.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from harness.errors import UsageError
from harness.rl.rewards import builtin, functions
from harness.rl.rewards.verifier import VerifierError

KINDS = ("function", "verifier", "model", "builtin")


class RewardError(UsageError):
    """A reward function raised (rl.reward_errors stop)."""


@dataclass
class Entry:
    name: str
    weight: float
    fn: object
    kind: str
    where: str


@dataclass
class RewardSet:
    entries: list[Entry]
    on_error: str = "stop"
    errors: dict = field(default_factory=dict)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(e.name for e in self.entries)

    @property
    def weights(self) -> tuple[float, ...]:
        return tuple(e.weight for e in self.entries)

    def score(self, *, prompts, completions, completion_ids, columns: dict) -> list[list]:
        per_fn = [self._one(e, prompts, completions, completion_ids, columns) for e in self.entries]
        return [list(row) for row in zip(*per_fn)] if per_fn else [[] for _ in completions]

    def _one(self, entry: Entry, prompts, completions, completion_ids, columns) -> list:
        n = len(completions)
        completion_ids = completion_ids if completion_ids is not None else [None] * n
        try:
            got = functions.call(entry.fn, prompts=prompts, completions=completions, completion_ids=completion_ids,
                                 columns=columns)
        except VerifierError as err:
            return self._failed(entry, None, err, n)
        except Exception:  # noqa: BLE001 - find the sample, then stop or zero per rl.reward_errors
            return [r for i in range(n) for r in self._sample(entry, i, prompts, completions, completion_ids, columns)]
        return _checked(entry, got, n)

    def _sample(self, entry: Entry, i: int, prompts, completions, completion_ids, columns) -> list:
        try:
            got = functions.call(entry.fn, prompts=[prompts[i]], completions=[completions[i]],
                                 completion_ids=[completion_ids[i]], columns={k: [v[i]] for k, v in columns.items()})
        except Exception as err:  # noqa: BLE001
            return self._failed(entry, (i, prompts[i], completions[i]), err, 1)
        return _checked(entry, got, 1)

    def _failed(self, entry: Entry, sample, err: Exception, n: int) -> list:
        if self.on_error == "zero":
            self.errors[entry.name] = self.errors.get(entry.name, 0) + n
            return [0.0] * n
        what = f"on sample {sample[0]} (prompt {str(sample[1])[:120]!r}, completion {str(sample[2])[:120]!r})" \
            if sample else "on its batch"
        raise RewardError(f"{entry.where} ({entry.name}) raised {type(err).__name__}: {err} {what}\n"
                          "    fix: make the function return a float or None for every completion, or set "
                          "rl.reward_errors=zero to score such samples 0") from err


def _checked(entry: Entry, got, n: int) -> list:
    """The function's answer as floats or None; a wrong shape or type stops the run whatever rl.reward_errors says
    (the function breaks TRL's contract for every sample, not one)."""
    problem = ""
    if not isinstance(got, (list, tuple)) or len(got) != n:
        problem = f"returned {type(got).__name__} of {len(got) if hasattr(got, '__len__') else '?'} items for " \
                  f"{n} completions"
    else:
        bad = [g for g in got if g is not None and (isinstance(g, bool) or not isinstance(g, (int, float)))]
        problem = f"returned {bad[0]!r} ({type(bad[0]).__name__}); expected float or None" if bad else ""
    if problem:
        raise RewardError(f"{entry.where} ({entry.name}) {problem}\n    fix: return one float (or None: not "
                          "applicable) per completion, in order")
    return [None if g is None else float(g) for g in got]


def _entry(i: int, raw, rl: dict, tokenizer, base_dir: Path, ds_config) -> Entry:
    where = f"rl.rewards[{i}]"
    raw = {"function": raw} if isinstance(raw, str) else dict(raw)
    kinds = [k for k in KINDS if raw.get(k) is not None]
    if len(kinds) != 1:
        raise UsageError(f"{where}: {raw} names {' and '.join(kinds) or 'none'} of {', '.join(KINDS)}\n"
                         "    fix: exactly one, e.g. {\"function\": \"my_rewards.py:accuracy\", \"weight\": 1.0}")
    kind = kinds[0]
    if kind == "function":
        fn = functions.load(raw["function"], base_dir, where)
        name = fn.__name__
    elif kind == "builtin":
        if raw["builtin"] not in builtin.NAMES:
            raise UsageError(f"{where}: no built-in reward {raw['builtin']!r}\n    fix: one of {', '.join(builtin.NAMES)}")
        if raw["builtin"] == "regex" and not raw.get("pattern"):
            raise UsageError(f"{where}: the regex built-in needs a pattern\n    fix: add \"pattern\": \"...\"")
        fn, name = builtin.make(raw, rl.get("sandbox") or {}), raw["builtin"]
    elif kind == "verifier":
        from harness.rl.rewards.verifier import verifier

        fn, name = verifier(raw), "verifier"
    else:
        from harness.rl.rewards.model import reward_model

        fn, name = reward_model(raw, policy_tokenizer=tokenizer, where=where, ds_config=ds_config), "reward_model"
    return Entry(raw.get("name") or name, float(raw.get("weight", 1.0)), fn, kind, where)


def load_rewards(rl: dict, *, tokenizer, base_dir, ds_config: dict | None = None,
                 environment_rewards: list | None = None) -> RewardSet:
    """The run's reward entries, loaded and checked (UsageError, exit 2, for a bad one). ds_config: the policy's
    DeepSpeed dict, so that a reward model is ZeRO-3-sharded where the policy is (None: a whole copy per rank).
    environment_rewards: (class name, function) of each environment with get_reward (weight 1, after rl.rewards,
    as TRL adds them)."""
    raw = list(rl.get("rewards") or [])
    entries = [_entry(i, r, rl, tokenizer, Path(base_dir), ds_config) for i, r in enumerate(raw)]
    entries += [Entry(name, 1.0, fn, "environment", f"rl.environment_factory ({name}.get_reward)")
                for name, fn in environment_rewards or []]
    if not entries:
        raise UsageError("rl.rewards: empty\n    fix: add a reward entry, e.g. [\"my_rewards.py:accuracy\"], or "
                         "give the environment class a get_reward method")
    names = [e.name for e in entries]
    for i, e in enumerate(entries):  # TRL logs rewards by function name: make them unique
        if names.count(e.name) > 1:
            e.name = f"{e.name}_{i}"
    return RewardSet(entries, on_error=rl.get("reward_errors", "stop"))
