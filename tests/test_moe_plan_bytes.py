"""The planner's bytes per rank equal the live engine's for a MoE model (issue #26): a tiny Qwen3-MoE (fp32) on 2 CPU
ranks under ZeRO-2 with DeepSpeed AutoEP at ep 2 and ZeRO-3 with the sparse block as leaf module, all in
one process group (tests/moe_bytes_driver.py). The planner side is computed from the config dict alone."""

from __future__ import annotations

import json

import pytest

from launch import launch

pytestmark = pytest.mark.multirank

TERMS = ("params", "grads", "fp32_master", "optimizer_moments")
RTOL = 0.02  # as the dense tests (tests/test_training.py STATE_RTOL); measured: equal to the byte


def test_planner_bytes_per_rank_equal_the_live_engines(tmp_path):
    out = tmp_path / "bytes.json"
    launch(str(out), script="tests/moe_bytes_driver.py", timeout_s=240)
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
        # experts over ep: a rank holds its 2 of 4 experts per sparse block, so fewer bytes than without EP
        assert sum(results["zero2 ep2"]["predicted"]["params"].values()) < 4 * 140_160  # the whole fp32 model (tests/moe_bytes_driver.CFG)
