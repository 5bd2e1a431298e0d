"""What each objective's user watches (harness/config/readouts.py), without ranks: the declarations, the [step] line's
text, the [done] line's windows, and the names the trackers get. The launches that show them on real ranks are in
test_grpo.py, test_preference.py and test_reward_model.py (tests/helpers/readouts.py)."""

from __future__ import annotations

import pytest

from harness import trackers
from harness.config import readouts
from harness.config.objectives import OBJECTIVES, all_tracked, readout_of

GRPO_RECORD = {"loss": -1e-9, "lr": 0.03, "grad_norm": 1.5, "reward": 0.25, "reward_std": 0.125,
               "rewards/vowels/mean": 0.25, "frac_reward_zero_std": 0.5, "completions/mean_length": 7.5,
               "clip_ratio/region_mean": 0.0, "kl": None, "entropy": 6.0, "time/generate_s": 0.03, "step_tokens": 60.0}


def test_each_objective_declares_its_readout_and_its_family_picks_the_report_section():
    sections = {"lm": None, "preference": "preference", "rl": "rl", "distill": None}
    for name, objective in OBJECTIVES.items():
        assert objective.readout.step and objective.readout.done, name
        assert objective.readout.section == sections[objective.family], name
    assert readout_of({"train": {"objective": "grpo"}}).done == ("reward", "completions/mean_length")
    assert readout_of({"train": {"objective": "dpo"}}).step == ("loss", "rewards_margin", "rewards_accuracy")
    assert readout_of({"train": {"objective": "reward"}}).done == ("loss", "rewards_accuracy", "rewards_margin")
    assert readout_of({"train": {}}).step == ("loss",)
    assert readout_of({"train": {"objective": "gkd"}}).step == ("loss", "entropy", "teacher_entropy",
                                                                "completions/mean_length")
    assert readout_of({"train": {"datasets": [{"name": "web"}]}}).done == ("loss", "loss/")  # a mixture's sources


def test_the_step_line_shows_what_the_step_logged_and_skips_the_rest():
    rl = readout_of({"train": {"objective": "grpo"}})
    # kl is None (beta 0), cispo_clip_ratio absent (loss type dapo): left out; the near-0 loss is not shown
    assert readouts.step_text(rl, GRPO_RECORD) == ("reward 0.2500 reward_std 0.1250 completions/mean_length 7.5000 "
                                                    "clip_ratio/region_mean 0.0000")
    mixture = readouts.Readout(step=("loss", "loss/"), done=("loss",))
    assert readouts.step_text(mixture, {"loss": 2.0, "loss/web": 3.0, "loss/chat": None, "loss/code": 1.0}) == (
        "loss 2.0000 loss/code 1.0000 loss/web 3.0000")


@pytest.mark.parametrize("count,steps", [(10, 3), (5, 2), (1, 1)])
def test_the_done_line_averages_a_window_at_each_end_at_most_half_the_steps(count, steps):
    rl = readout_of({"train": {"objective": "grpo"}})
    records = [{"reward": float(i), "completions/mean_length": 8.0 - i} for i in range(count)]
    found = readouts.ends(rl, records)
    first, last = sum(range(steps)) / steps, sum(range(count - steps, count)) / steps
    assert found["reward"] == {"first": first, "last": last, "steps": steps}
    text = readouts.ends_text(found)
    assert text.startswith(f"reward {first:.4f} -> {last:.4f}, completions/mean_length {8 - first:.4f} -> ")
    assert text.endswith(f"(means of the first and last {steps} steps)") == (steps > 1)
    assert readouts.ends_text({}) == "no step logged"


def test_a_new_objective_plugs_in_by_one_declaration():
    gkd = readouts.Readout(step=("loss", "teacher_entropy"), done=("loss",))
    record = {"loss": 1.25, "teacher_entropy": 2.5, "lr": 1e-3}
    assert readouts.step_text(gkd, record) == "loss 1.2500 teacher_entropy 2.5000"
    assert readouts.ends(gkd, [record, {**record, "loss": 0.75}])["loss"] == {"first": 1.25, "last": 0.75, "steps": 1}
    assert readouts.tracked(gkd) == ("loss", "teacher_entropy")
    for objective in OBJECTIVES.values():  # every declared name reaches the trackers and the monitors
        assert set(readouts.tracked(objective.readout)) <= set(all_tracked())


def test_the_trackers_get_the_objectives_names_as_metrics_jsonl_spells_them():
    got = trackers.step_metrics("train", GRPO_RECORD, None)
    for name in ("reward", "reward_std", "rewards/vowels/mean", "frac_reward_zero_std", "completions/mean_length",
                 "clip_ratio/region_mean", "entropy", "time/generate_s", "step_tokens"):
        assert got[f"train/{name}"] == GRPO_RECORD[name], name
    assert "train/kl" not in got  # None: not logged
    # a name and a prefix over it (completions/mean_length, completions/): one key, one event for DeepSpeed's monitor
    assert readouts.keys(all_tracked(), GRPO_RECORD).count("completions/mean_length") == 1
    dpo = trackers.step_metrics("train", {"loss": 0.7, "rewards_margin": 0.1, "rewards_accuracy": 0.5}, None)
    assert dpo == {"train/loss": 0.7, "train/rewards_margin": 0.1, "train/rewards_accuracy": 0.5}
    summary = {"readouts": {"reward": {"first": 0.2, "last": 0.6, "steps": 3}}}
    assert trackers.summary_metrics(summary) == {"summary/reward/first": 0.2, "summary/reward/last": 0.6}
