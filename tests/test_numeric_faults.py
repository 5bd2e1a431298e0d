"""Numeric faults (harness/train/faults.py): a NaN in one rank's batch is seen by every rank in the same step.

One 2-rank launch runs the cases, each with DSHARNESS_INJECT_LOSS="4:1:nan,6:0:100": rank 1's loss is NaN on data
batch 4 (the 5th step), rank 0's is x100 on batch 6 (a spike where the rule is on; a merely clipped step elsewhere):
  stop      ZeRO-3: exit 3 naming step 5, rank 1, its rows and documents; `latest` still global_step4 and complete
  skip      ZeRO-2: the checkpoints before and after the dropped step hold the same weights and optimizer state
  rollback  ZeRO-2: reloads global_step4 and trains on without batch 4: its steps 5.. equal the skip run's 6..
  spike     ZeRO-0 (torch optimizer): the NaN step and the x100 step are both dropped, weights unchanged by each
  dpo       ZeRO-2, a DPO run on the builtin pairs: the NaN step is dropped as under skip, named by pairs and records
The fast tests cover the running median, the data-step mapping and the recipe refusals.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from harness.errors import Problem
from harness.report.faults import faults_line, faults_section
from harness.train.faults import DataSteps, Policy, SpikeRule, parse_injection, recipe_problems
from harness.train.metrics import read_metrics
from helpers.launch import job_output, launch_jobs, losses, records
from helpers.parity import common_args

INJECT = "4:1:nan,6:0:100"
STEPS = 8


def test_spike_rule_judges_against_the_running_median_once_the_window_is_full():
    rule = SpikeRule(3.0, 4)
    for loss in (2.0, 10.0, 2.2):
        assert rule.judge(100.0) is None  # not judged before the window is full
        rule.keep(loss)
    rule.keep(1.8)  # median of (2.0, 10.0, 2.2, 1.8) = 2.1: the one outlier does not move it
    assert rule.judge(6.5) == pytest.approx(2.1)  # 6.5 > 3 x 2.1
    assert rule.judge(6.2) is None
    rule.keep(2.0)  # the window slides: (10.0, 2.2, 1.8, 2.0), median still 2.1
    assert rule.judge(6.4) == pytest.approx(2.1)
    assert SpikeRule(0.0, 2).judge(1e9) is None  # 0: off


def test_data_steps_step_over_the_batches_a_rollback_skipped():
    steps = DataSteps([5, 4, 4])
    assert [steps.batch(s) for s in range(7)] == [0, 1, 2, 3, 6, 7, 8] and steps.skipped == [4, 5]
    assert DataSteps([0, 2]).batch(0) == 1 and DataSteps([0, 2]).batch(1) == 3


def test_policy_limits_count_in_a_row_and_rollbacks_without_progress():
    skip = Policy({"on_nonfinite": "skip", "nonfinite_limit": 2})
    assert skip.action(4) == ("skip", None)
    skip.kept(5)  # a kept step ends the run of faults
    assert skip.action(6) == ("skip", None)
    action, why = skip.action(7)
    assert action == "stop" and "2 faulty steps in a row" in why
    back = Policy({"on_nonfinite": "rollback", "nonfinite_limit": 2})
    assert back.action(4)[0] == back.action(4)[0] == "rollback"  # two rollbacks, never past step 4
    back.kept(3)  # replaying the steps before the fault is not progress
    assert back.action(4)[0] == "stop"
    again = Policy({"on_nonfinite": "rollback", "nonfinite_limit": 1})
    assert again.action(4)[0] == "rollback"
    again.kept(4)  # past the fault: progress
    assert again.action(9)[0] == "rollback"
    assert Policy({"on_nonfinite": "stop", "nonfinite_limit": 3}).action(0)[0] == "stop"


def test_injection_hook_and_recipe_refusals():
    assert parse_injection("4:1:nan,6:0:100") == {(4, 1): pytest.approx(math.nan, nan_ok=True), (6, 0): 100.0}
    assert parse_injection(None) == {} and parse_injection("2:0:grad") == {(2, 0): "grad"}
    off = recipe_problems({"train": {"spike": 3, "on_nonfinite": "off"}})
    assert [p.path for p in off] == ["train.spike"] and "on_nonfinite" in off[0].fix
    assert isinstance(recipe_problems({"train": {"spike": 1, "on_nonfinite": "skip"}})[0], Problem)
    assert recipe_problems({"train": {"spike": 3, "on_nonfinite": "skip"}}) == []


def _args(recipe: str, run, policy: str, save_every: int, *extra: str) -> list[str]:
    return ["--recipe", recipe, "--set", "precision=fp32", "--output-dir", str(run),
            *common_args(STEPS, 64, 4, save_every), "--set", "train.keep_last=0", "--set",
            f"train.on_nonfinite={policy}", *extra]


def _tensors(obj, prefix=""):
    """Every tensor in a (nested) state dict, by path."""
    if torch.is_tensor(obj):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{prefix}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{prefix}/{i}")


def _state(run, step: int) -> dict:
    """Weights and optimizer state of a checkpoint: every tensor of its files (counters and flags are not)."""
    folder = run / "checkpoints" / f"global_step{step}"
    out = {}
    for path in sorted(folder.glob("*states.pt")):
        sd = torch.load(path, map_location="cpu", weights_only=False)
        for key in ("module", "optimizer", "optimizer_state_dict"):
            out.update({f"{path.name}{k}": t for k, t in _tensors(sd.get(key), f"/{key}")})
    assert out, f"no state in {folder}"
    return out


def assert_same_state(run, before: int, after: int) -> None:
    a, b = _state(run, before), _state(run, after)
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"global_step{before} -> global_step{after} changed {differ[:5]}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    cases = [{"argv": _args("zero3", root / "stop", "stop", 2), "code": 3},
             _args("zero2", root / "skip", "skip", 1),
             _args("zero2", root / "rollback", "rollback", 2),
             _args("ddp", root / "spike", "skip", 1, "--set", "train.spike=5", "--set", "train.spike_window=2"),
             _args("zero2", root / "dpo", "skip", 1, "--set", "train.objective=dpo", "--set", "train.seq_len=128")]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DSHARNESS_INJECT_LOSS", INJECT)
        proc = launch_jobs(cases, root)
    return root, proc


@pytest.mark.multirank
def test_stop_names_step_rank_and_rows_and_leaves_latest(runs):
    root, proc = runs
    run = root / "stop"
    said = job_output(proc.stdout, 0) + job_output(proc.stderr, 0)
    assert "numeric fault at step 5 (data batch 4): non-finite loss on rank 1" in said, said[-3000:]
    assert "documents [" in said and "store rows [" in said and "`latest` names global_step4" in said
    assert (run / "checkpoints" / "latest").read_text().strip() == "global_step4"
    assert (run / "checkpoints" / "global_step4" / "manifest.json").is_file()
    assert not list((run / "checkpoints").glob("global_step[5-9]"))
    fault, = records(run, "fault")
    assert (fault["step"], fault["ranks"], fault["action"], fault["batch"]) == (5, [1], "stop", 4)
    assert sorted(losses(run)) == [1, 2, 3, 4]


@pytest.mark.multirank
def test_skip_drops_the_update_and_goes_on(runs):
    root, _ = runs
    run = root / "skip"
    assert_same_state(run, 4, 5)  # the dropped step changed no weight and no optimizer state
    with pytest.raises(AssertionError):
        assert_same_state(run, 5, 6)  # (the comparison can fail: a kept step changes them)
    fault, = records(run, "fault")
    assert (fault["step"], fault["ranks"], fault["action"], fault["reason"]) == (5, [1], "skip", "nonfinite")
    assert sorted(losses(run)) == [1, 2, 3, 4, 6, 7, 8] and all(map(math.isfinite, losses(run).values()))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == STEPS


@pytest.mark.multirank
def test_rollback_reloads_and_continues_without_the_batch(runs):
    root, _ = runs
    run, skip = losses(root / "rollback"), losses(root / "skip")
    back, = records(root / "rollback", "rollback")
    assert (back["step"], back["tag"], back["skipped_batch"]) == (4, "global_step4", 4)
    for step in range(1, 5):
        assert run[step] == skip[step]
    # without batch 4 the rollback run's step k trains on batch k, as the skip run's step k + 1 does, from the
    # same weights and optimizer state (and, with no scheduler, the same LR): bit-equal after the in-process reload
    for step in range(5, STEPS):
        assert run[step] == skip[step + 1], (step, run[step], skip[step + 1])
    client = torch.load(root / "rollback" / "checkpoints" / f"global_step{STEPS}" / "mp_rank_00_model_states.pt",
                        map_location="cpu", weights_only=False)
    assert client["skipped_batches"] == [4]  # a resume keeps stepping over it


@pytest.mark.multirank
def test_spike_rule_drops_a_forced_spike_on_the_plain_optimizer(runs):
    root, _ = runs
    run = root / "spike"
    faults = records(run, "fault")
    assert [(f["step"], f["reason"], f["action"]) for f in faults] == [(5, "nonfinite", "skip"), (7, "spike", "skip")]
    assert faults[1]["loss"] > 5 * faults[1]["median"]
    report = "\n".join(faults_line(read_metrics(run)) + faults_section(read_metrics(run)))
    assert "2 steps dropped (2 skipped" in report and "| 5 | 4 | non-finite loss | 1 |" in report
    assert "| 7 | 6 | loss spike | 0, 1 |" in report
    assert_same_state(run, 4, 5)
    assert_same_state(run, 6, 7)


@pytest.mark.multirank
def test_a_preference_run_names_the_pairs_and_their_records(runs):
    root, proc = runs
    run = root / "dpo"
    fault, = records(run, "fault")
    assert (fault["step"], fault["ranks"], fault["action"], fault["batch"]) == (5, [1], "skip", 4)
    assert fault["rows"]["1"].startswith("pairs [") and ", dataset records [" in fault["rows"]["1"], fault["rows"]
    said = job_output(proc.stdout, 4) + job_output(proc.stderr, 4)
    assert "non-finite loss on rank 1 (rank 1: pairs [" in said and "update dropped, step skipped" in said
    assert_same_state(run, 4, 5)
    assert sorted(losses(run)) == [1, 2, 3, 4, 6, 7, 8] and all(map(math.isfinite, losses(run).values()))
    assert {"rewards_margin", "rewards_accuracy"} <= set(records(run, "train")[-1])
