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
readout     what its user watches (harness/config/readouts.py): the [step] and [done] lines, summary.json, the
            report's headline and section, the trackers; an lm run over train.datasets watches its per-source losses
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.config.readouts import DISTILL, LM, MIXTURE, PREFERENCE, REWARD_MODEL, RL, Readout
from harness.config.readouts import tracked as readouts_tracked


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
    readout: Readout  # what its user watches


_PREF = "harness.train.preference:PreferenceSteps"
_DISTILL = "harness.train.distill:DistillSteps"
OBJECTIVES = {o.name: o for o in (
    Objective("lm", "lm", "corpus", 1, None, (), None, "rows", "docs/data.md", LM),
    Objective("dpo", "preference", "pairs", 2, "preference", ("reference",), _PREF, "pairs", "docs/preference.md",
              PREFERENCE),
    Objective("ipo", "preference", "pairs", 2, "preference", ("reference",), _PREF, "pairs", "docs/preference.md",
              PREFERENCE),
    Objective("simpo", "preference", "pairs", 2, "preference", (), _PREF, "pairs", "docs/preference.md", PREFERENCE),
    Objective("orpo", "preference", "pairs", 2, "preference", (), _PREF, "pairs", "docs/preference.md", PREFERENCE),
    Objective("reward", "preference", "pairs", 2, "preference", (), "harness.train.reward:RewardSteps", "pairs",
              "docs/rl.md", REWARD_MODEL),
    Objective("grpo", "rl", "prompts", 1, "rl", ("reference",), "harness.train.grpo:GrpoSteps", "rollouts",
              "docs/rl.md", RL),
    Objective("gkd", "distill", "completions", 1, "distill", ("teacher",), _DISTILL, "distill",
              "docs/distillation.md", DISTILL),
    Objective("distill", "distill", "prompts", 1, "distill", ("teacher",), _DISTILL, "distill",
              "docs/distillation.md", DISTILL),
)}


def objective_of(recipe: dict) -> Objective:
    """The recipe's train.objective as declared here (the schema's enum is the same names)."""
    return OBJECTIVES[recipe.get("train", {}).get("objective", "lm")]


def readout_of(recipe: dict) -> Readout:
    """What the recipe's run shows (harness/config/readouts.py): its objective's, or a mixture's per-source losses."""
    objective = objective_of(recipe)
    return MIXTURE if objective.name == "lm" and recipe.get("train", {}).get("datasets") else objective.readout


def all_tracked() -> tuple[str, ...]:
    """Every name some objective sends to the trackers (harness/trackers/, profiling/monitor.py)."""
    return tuple(dict.fromkeys(n for r in (*(o.readout for o in OBJECTIVES.values()), MIXTURE)
                               for n in readouts_tracked(r)))


def family(recipe: dict) -> str:
    return objective_of(recipe).family
