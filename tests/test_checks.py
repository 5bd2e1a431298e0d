"""Pure parts of the pre-training checks: which DeepSpeed ops a config needs, and the checkpoint size."""
from __future__ import annotations

import pytest

from harness.ops import needed_ops
from harness.planner.memory import checkpoint_bytes

OFFLOAD = "zero_optimization.offload_optimizer.device"


@pytest.mark.parametrize("zero, optimizer, ops", [
    ({"stage": 0}, "AdamW", {}),
    ({"stage": 2, "offload_optimizer": {"device": "none"}}, "AdamW", {}),
    ({"stage": 2, "offload_optimizer": {"device": "cpu"}}, "AdamW", {"cpu_adam": OFFLOAD}),
    ({"stage": 3, "offload_optimizer": {"device": "cpu"}}, "Lion", {"cpu_lion": OFFLOAD}),
    ({"stage": 3, "offload_optimizer": {"device": "cpu"}}, "Adagrad", {"cpu_adagrad": OFFLOAD}),
    ({"stage": 3, "offload_optimizer": {"device": "cpu"}}, "SGD", {}),  # no DeepSpeed CPU op for it
    # below stage 3 DeepSpeed treats nvme as cpu: no async_io
    ({"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/n"}}, "AdamW", {"cpu_adam": OFFLOAD}),
    ({"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/n"}}, "AdamW",
     {"async_io": "zero_optimization.offload_param.device", "pin_memory": "zero_optimization.offload_param.device"}),
    ({"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/n"}}, "AdamW",
     {"async_io": OFFLOAD, "pin_memory": OFFLOAD, "cpu_adam": OFFLOAD}),
])
def test_needed_ops(zero, optimizer, ops):
    assert needed_ops({"zero_optimization": zero, "optimizer": {"type": optimizer}}) == ops


def test_checkpoint_bytes_are_weights_plus_master_and_adam_moments():
    assert checkpoint_bytes(1, "bf16") == 2 + 4 + 8
    assert checkpoint_bytes(1, "fp32") == 4 + 4 + 8
    assert checkpoint_bytes(7_000_000_000, "bf16") == 98_000_000_000


def test_a_stale_build_lock_is_reported_with_its_path_not_waited_on(tmp_path, monkeypatch):
    """torch takes `lock` in an op's extensions folder on every load of a JIT op and waits on it without a
    timeout: one left by a killed compile would hang every rank. A fresh lock (a compile under way) is not
    reported."""
    import os
    import time

    from harness.ops import STALE_LOCK_S, op_problem

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "cpu_adam" / "lock"
    lock.parent.mkdir()
    lock.touch()
    assert op_problem("cpu_adam") is None or "lock" not in op_problem("cpu_adam")[0]
    old = time.time() - STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    why, fix = op_problem("cpu_adam")
    assert f"the cpu_adam op's build lock {lock} is 21 min old" in why and fix.startswith(f"rm {lock}")
