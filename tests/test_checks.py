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
