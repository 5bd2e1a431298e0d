"""The planner's bytes per rank equal the live engine's for a MoE model (issue #26): a tiny Qwen3-MoE (fp32) on 2 CPU
ranks under ZeRO-2 with DeepSpeed AutoEP at ep 2 and ZeRO-3 with the sparse block as leaf module, all in
one process group (tests/drivers/moe_plan_bytes.py), and the all-to-all bytes DeepSpeed's comms logger counted against
the planner's. The planner side is computed from the config dict alone."""

from __future__ import annotations

import json

import pytest

from helpers.launch import launch

pytestmark = pytest.mark.multirank

TERMS = ("params", "grads", "fp32_master", "optimizer_moments")
RTOL = 0.02  # as the dense tests (tests/helpers/parity.py STATE_RTOL); measured: equal to the byte


def test_planner_bytes_per_rank_equal_the_live_engines(tmp_path):
    out = tmp_path / "bytes.json"
    launch(str(out), script="tests/drivers/moe_plan_bytes.py", timeout_s=240)
    for rank in (0, 1):
        results = json.loads((tmp_path / f"bytes.json.rank{rank}").read_text())
        assert sorted(results) == ["zero2 ep2", "zero3 leaves"]
        for name, r in results.items():
            assert r["autoep_layers"] == (2 if "ep2" in name else 0), (name, r["autoep_layers"])
            for term in TERMS:
                got = sum(r["measured"].get(term, {}).values())
                want = sum(r["predicted"][term].values())
                assert abs(got - want) <= RTOL * want, f"rank {rank} {name} {term}: engine {got} vs planner {want}"
                print(f"rank {rank} {name} {term}: engine {got} planner {want}")
                run = sum(r["run_predicted"][term].values())  # the run's report (harness.planner.evaluate)
                assert abs(got - run) <= RTOL * run, f"rank {rank} {name} {term}: engine {got} vs the run's {run}"
        # experts over ep: a rank holds its 2 of 4 experts per sparse block, so fewer bytes than without EP
        assert sum(results["zero2 ep2"]["predicted"]["params"].values()) < 4 * 140_160
    # all-to-all: each call is logged at its input (what the rank sends). Dispatch and the combine's backward send
    # tokens x top_k rows from every rank; the combine and the dispatch's backward send back what the rank's experts
    # received, which depends on the routing. Summed over the expert-parallel group the bytes are the planner's
    # (balanced) per-rank figure times ep, for any routing.
    sent = [json.loads((tmp_path / f"bytes.json.rank{r}").read_text())["zero2 ep2"] for r in (0, 1)]
    planned = sent[0]["all_to_all_planned"]
    assert planned == 4 * 2 * 16 * 2 * 2 * 64 * 4  # 4 calls x 2 sparse blocks x (16 x 2 tokens) x top 2 x 64 x fp32
    assert sent[0]["all_to_all"] + sent[1]["all_to_all"] == 2 * planned, [s["all_to_all"] for s in sent]
    print("all_to_all_single bytes per rank (comms logger):", [s["all_to_all"] for s in sent], "planner", planned)  # the whole fp32 model (tests/drivers/moe_plan_bytes.CFG)
