"""A resumed process continues DeepSpeed's CPU Adam bit for bit (harness/checkpoint/adam_powers.py, issue #33 part 4).

The real optimizers (FusedAdam on the CPU accelerator, DeepSpeedCPUAdam) and their C++ kernels, in this process:
A steps 1..16 uninterrupted; B loads A's state after step 12 into a new optimizer and steps 13..16. Without the
rebuild B's kernel takes beta2^13 from pow, 1 ulp off A's running product (betas 0.9, 0.95), and B's weights end
different; with it they end bit-equal to A's. The multi-rank proof, killed twice under --max-restarts, is in
tests/test_restarts.py.
"""

from __future__ import annotations

import copy

import pytest
import torch

from harness.checkpoint import adam_powers

BETAS, LOADED, TOTAL = (0.9, 0.95), 12, 16


def optimizers():
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    return {"FusedAdam": lambda params: FusedAdam(params, lr=1e-3, betas=BETAS, weight_decay=0.01),
            "DeepSpeedCPUAdam": lambda params: DeepSpeedCPUAdam(params, lr=1e-3, betas=BETAS, weight_decay=0.01)}


def grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return [torch.randn(37, generator=g), torch.randn(5, generator=g)]


def train(opt, params, steps: range) -> None:
    for step in steps:
        for p, g in zip(params, grads(step)):
            p.grad = g.clone()
        opt.step()


def fresh_params() -> list[torch.Tensor]:
    """Zeros: the weights are then the sum of the updates, so a last-bit change of one update shows in them."""
    return [torch.zeros(37), torch.zeros(5)]


@pytest.mark.parametrize("name, zero3", [("FusedAdam", False), ("DeepSpeedCPUAdam", False), ("FusedAdam", True)])
def test_a_loaded_optimizer_continues_bit_for_bit_after_the_rebuild(name, zero3):
    """zero3: the param groups hold no params at the load, as ZeRO-3 leaves them between its sub-group steps."""
    make = optimizers()[name]
    params = fresh_params()
    # two param groups, as the harness builds them (decay and no decay): the kernel is called for each per step
    straight = make([{"params": [params[0]]}, {"params": [params[1]], "weight_decay": 0.0}])
    train(straight, params, range(1, LOADED + 1))
    saved_params, saved_state = [p.clone() for p in params], copy.deepcopy(straight.state_dict())
    train(straight, params, range(LOADED + 1, TOTAL + 1))

    ends = {}
    for rebuilt in (False, True):
        resumed = [p.clone() for p in saved_params]
        opt = make([{"params": [resumed[0]]}, {"params": [resumed[1]], "weight_decay": 0.0}])
        opt.load_state_dict(copy.deepcopy(saved_state))
        if rebuilt:
            held = [g["params"] for g in opt.param_groups]
            for group in opt.param_groups if zero3 else ():
                group["params"] = []
            assert adam_powers.rebuild(opt) == LOADED
            for group, params_ in zip(opt.param_groups, held):
                group["params"] = params_
        train(opt, resumed, range(LOADED + 1, TOTAL + 1))
        ends[rebuilt] = all(torch.equal(a, b) for a, b in zip(params, resumed))
    assert ends == {False: False, True: True}, f"bit-equal to the uninterrupted optimizer: {ends}"


def test_the_replay_stops_once_the_powers_no_longer_matter():
    from deepspeed.ops.adam import FusedAdam

    p = torch.zeros(37)
    opt = FusedAdam([p], lr=1e-3, betas=(0.5, 0.6))
    train(opt, [p], range(1, 2))
    opt.state[p]["step"] = 10_000
    replayed = adam_powers.rebuild(opt)
    assert replayed == 41, replayed  # 0.6^41 < 2^-30: every later bias correction is exactly 1
    assert adam_powers.rebuild(torch.optim.SGD([p], lr=0.1)) == 0  # no stateful kernel: nothing to do
