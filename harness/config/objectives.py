"""The training objectives (train.objective), each declared once: its family, the data it reads, the sequences one
batch item holds, the recipe block of its keys, the extra models it may load, its step and its planner terms.

A new objective (distillation, say) is one `Objective` line here plus its own module: the trainer, the data loading,
the rules and the planner ask this table, never a list of names of their own. Pure: no torch, no engine; `steps`
names the step class as "module:Class" (harness/train/ or harness/rl/), which harness/train/trainer.py imports when
the run starts (tests/test_objectives.py imports every one).

family      lm: next-token loss on packed rows; preference: pairs of completions, one loss per pair; rl: completions
            generated in the loop and scored by rewards; distill: a teacher's next-token distributions over completions
            (harness/train/distill*.py, docs/distillation.md)
data        corpus: the token store's rows (harness/data/store.py); pairs: the pair store (harness/data/
            preference.py); prompts: a prompt set (harness/rl/prompts.py); completions: prompt + completion records,
            one per row (harness/train/distill_data.py)
rows        sequences one batch item (one count of the batch keys) holds: a pair is 2; a completion is 1
extra       the models beside the policy it may load: reference (a frozen copy or the adapters off), teacher, none
planner     what the planner prices for it (harness/planner/): rows (the LM's), pairs (2 rows, a reference per mode),
            rollouts (generation, the reward and reference models; `harness plan --objective grpo`), distill (the
            teacher, the logits, rollouts when on-policy)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Objective:
    name: str
    family: str  # lm | preference | rl | distill
    data: str  # corpus | pairs | prompts | completions
    rows: int  # sequences per batch item
    block: str | None  # the recipe block holding its keys (None: train only)
    extra: tuple[str, ...]  # models beside the policy: "reference", "teacher"
    steps: str | None  # "module:Class" of its step; None: the trainer's own LM paths (pipeline, sequence, plain)
    planner: str  # rows | pairs | rollouts | distill
    doc: str  # the docs page


_PREF = "harness.train.preference:PreferenceSteps"
_DISTILL = "harness.train.distill:DistillSteps"
OBJECTIVES = {o.name: o for o in (
    Objective("lm", "lm", "corpus", 1, None, (), None, "rows", "docs/data.md"),
    Objective("dpo", "preference", "pairs", 2, "preference", ("reference",), _PREF, "pairs", "docs/preference.md"),
    Objective("ipo", "preference", "pairs", 2, "preference", ("reference",), _PREF, "pairs", "docs/preference.md"),
    Objective("simpo", "preference", "pairs", 2, "preference", (), _PREF, "pairs", "docs/preference.md"),
    Objective("orpo", "preference", "pairs", 2, "preference", (), _PREF, "pairs", "docs/preference.md"),
    Objective("reward", "preference", "pairs", 2, "preference", (), "harness.train.reward:RewardSteps", "pairs",
              "docs/rl.md"),
    Objective("grpo", "rl", "prompts", 1, "rl", ("reference",), "harness.train.grpo:GrpoSteps", "rollouts",
              "docs/rl.md"),
    Objective("gkd", "distill", "completions", 1, "distill", ("teacher",), _DISTILL, "distill", "docs/distillation.md"),
    Objective("distill", "distill", "prompts", 1, "distill", ("teacher",), _DISTILL, "distill",
              "docs/distillation.md"),
)}


def objective_of(recipe: dict) -> Objective:
    """The recipe's train.objective as declared here (the schema's enum is the same names)."""
    return OBJECTIVES[recipe.get("train", {}).get("objective", "lm")]


def family(recipe: dict) -> str:
    return objective_of(recipe).family
