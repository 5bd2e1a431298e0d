"""rl.generator=hf on real DeepSpeed ranks (tests/drivers/generation.py, one launch of 2 ranks): greedy completions
under ZeRO-3 (whole gather; layer groups; groups with parameter offload; groups with LoRA active) and ZeRO-2 equal
one process's transformers generate token for token, before and after an optimizer step (the generator sees the new
weights); the whole-held parameter bytes during generation equal planner/rl.py's peak for the bound; ZeRO-3's own
hooks fetch nothing while generating and are back for the next training forward; sampling repeats for a seed.
Multi-turn (harness/rl/multiturn.py, the tool model on ZeRO-3 in one-layer groups, the ranks' rows taking different
numbers of turns): the whole-held bytes over every turn's generate call equal the planner's peak for the bound, and
each call's KV cache (its padded sequences x tokens) stays within the planner's for prompt + max_completion_length."""

from __future__ import annotations

import json

import pytest

from tests.helpers.launch import launch
from tests.helpers.models import llama_folder
from tests.helpers.tool_models import call_text, tool_model_folder

CASES = ("z3_whole", "z3_groups", "z3_offload_groups", "z3_lora_groups", "z2")
GROUPS = {"z3_whole": [[0, 1, 2, 3]], "z3_groups": [[0], [1], [2], [3]], "z3_offload_groups": [[0, 1], [2, 3]],
          "z3_lora_groups": [[0], [1], [2], [3]], "z2": []}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("rl_generation")
    model = llama_folder(folder / "model", layers=4)
    out = folder / "out.json"
    busy = {call_text("reveal"): 4.5, call_text("broken"): 3.0, "<|im_end|>": 5.0}  # calls sampled more often
    launch(model, str(out), tool_model_folder(folder / "tool_model", logit_boost=busy),
           script="tests/drivers/generation.py", timeout_s=600)
    return [json.loads((folder / f"out.json.rank{r}").read_text()) for r in (0, 1)]


@pytest.mark.multirank
@pytest.mark.parametrize("name", CASES)
def test_greedy_completions_equal_one_process_generate_before_and_after_a_step(ranks, name):
    for rank in ranks:
        got = rank[name]
        assert got["before_gen"] == got["before_ref"], (rank["rank"], got["before_gen"], got["before_ref"])
        assert got["after_gen"] == got["after_ref"], (rank["rank"], got["after_gen"], got["after_ref"])
        assert got["before_gen"] != got["after_gen"], "the step changed nothing the test can see"
        assert all(1 <= len(c) <= 10 for c in got["before_gen"] + got["after_gen"])
        assert got["before_groups"] == GROUPS[name]
    if name == "z3_groups":  # one rank's rows all stop at EOS long before the other's (generate's synced_gpus)
        lengths = [max(map(len, rank[name]["after_gen"])) for rank in ranks]
        assert lengths == [1, 10], lengths


@pytest.mark.multirank
@pytest.mark.parametrize("name", CASES)
def test_gathered_bytes_equal_the_planner_and_zero_hooks_stay_off(ranks, name):
    for rank in ranks:
        got = rank[name]
        assert got["peak_held_bytes"] == got["plan"]["peak_bytes"], (got["peak_held_bytes"], got["plan"])
        assert got["hook_fetches"] == 0, "ZeRO-3's hooks fetched parameters during generation"
        if name.startswith("z3"):
            assert got["train_hook_fetches"] > 0, "ZeRO-3's hooks did not come back for training"
    plan = ranks[0][name]["plan"]
    if name in ("z3_groups", "z3_lora_groups"):  # the bound was one layer past the embeddings and head
        assert not plan["whole"] and plan["num_groups"] == 4
        assert plan["peak_bytes"] < ranks[0]["z3_whole"]["plan"]["peak_bytes"] * 0.55


@pytest.mark.multirank
def test_sampling_repeats_for_a_seed_and_differs_across_seeds(ranks):
    for rank in ranks:
        for name in CASES:
            same, again, other = rank[name]["sampled"]
            assert same == again and same != other
        assert rank["z3_groups"]["sampled"][0] == rank["z2"]["sampled"][0]  # layout-free given the weights


@pytest.mark.multirank
def test_multi_turn_generation_stays_within_the_planners_bound(ranks):
    got = [rank["z3_multi_turn"] for rank in ranks]
    print("multi-turn per rank: turns", [g["turns"] for g in got], "calls (sequences, tokens)",
          [g["calls"] for g in got], "KV", [(g["kv_bytes"], g["plan_kv_bytes"]) for g in got])
    assert len(got[0]["calls"]) == len(got[1]["calls"]) > 1  # lockstep: as many generate calls on each rank
    assert max(max(g["turns"]) for g in got) > 1 and sorted(got[0]["turns"]) != sorted(got[1]["turns"])
    for g in got:
        assert g["peak_held_bytes"] == g["plan"]["peak_bytes"] and not g["plan"]["whole"], g
        assert g["hook_fetches"] == 0 and g["kv_bytes"] <= g["plan_kv_bytes"] and max(g["completion"]) <= 160
