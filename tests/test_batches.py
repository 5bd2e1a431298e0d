"""BatchPlan: the rows every rank trains on are a pure function of the step."""

import pytest
import torch

from harness.data.batches import BatchPlan


def plans(num_rows=100, micro=2, gas=3, dp=2, seed=5):
    gb = micro * gas * dp
    return [BatchPlan(num_rows=num_rows, global_batch=gb, micro_batch=micro, grad_accum=gas,
                      dp_rank=r, dp_size=dp, seed=seed) for r in range(dp)]


def test_union_over_ranks_is_the_global_batch_in_rank_order():
    ranks = plans()
    for step in range(20):
        pieces = [mb for plan in ranks for mb in plan.micro_batches(step)]
        assert all(len(mb) == 2 for mb in pieces)
        assert len(pieces) == 2 * 3  # dp_size * grad_accum micro-batches per step
        assert torch.equal(torch.cat(pieces), ranks[0].global_rows(step))


def test_ranks_see_disjoint_rows_within_a_step():
    ranks = plans(dp=4, gas=1)
    for step in range(8):
        rows = [set(torch.cat(p.micro_batches(step)).tolist()) for p in ranks]
        assert sum(len(r) for r in rows) == len(set().union(*rows)) == 8


def test_single_process_plan_matches_data_parallel_plan():
    """Loss parity: one process with grad_accum = dp*gas sees the same rows per step as dp ranks."""
    single = BatchPlan(num_rows=100, global_batch=12, micro_batch=2, grad_accum=6, seed=5)
    for step in range(30):
        multi = torch.cat([mb for plan in plans() for mb in plan.micro_batches(step)])
        assert torch.equal(torch.cat(single.micro_batches(step)), multi)


def test_deterministic_and_pure_function_of_step():
    a, b = plans()[1], plans()[1]
    forward = [a.micro_batches(s) for s in range(25)]
    backward = [b.micro_batches(s) for s in reversed(range(25))][::-1]
    for x, y in zip(forward, backward):
        assert all(torch.equal(u, v) for u, v in zip(x, y))


def test_resume_at_step_equals_uninterrupted_run():
    uninterrupted = [plans()[0].global_rows(s) for s in range(40)]
    resumed_plan = plans()[0]  # a fresh object: nothing carried over but the step number
    resumed = [resumed_plan.global_rows(s) for s in range(17, 40)]
    assert all(torch.equal(x, y) for x, y in zip(uninterrupted[17:], resumed))


def test_epochs_roll_over_with_a_new_permutation_and_drop_the_tail():
    plan = BatchPlan(num_rows=50, global_batch=12, micro_batch=12, grad_accum=1, seed=3)
    assert plan.steps_per_epoch == 4  # 50 // 12; 2 tail rows dropped each epoch
    assert [plan.epoch_of(s) for s in range(9)] == [0, 0, 0, 0, 1, 1, 1, 1, 2]
    epoch0 = torch.cat([plan.global_rows(s) for s in range(4)])
    epoch1 = torch.cat([plan.global_rows(s) for s in range(4, 8)])
    assert len(set(epoch0.tolist())) == 48 and len(set(epoch1.tolist())) == 48  # no repeats inside an epoch
    assert torch.equal(epoch0, torch.randperm(50, generator=torch.Generator().manual_seed(3))[:48])
    assert torch.equal(epoch1, torch.randperm(50, generator=torch.Generator().manual_seed(4))[:48])
    assert not torch.equal(epoch0, epoch1)


def test_seed_changes_the_order():
    a = BatchPlan(num_rows=64, global_batch=8, micro_batch=8, grad_accum=1, seed=0)
    b = BatchPlan(num_rows=64, global_batch=8, micro_batch=8, grad_accum=1, seed=1)
    assert not torch.equal(a.global_rows(0), b.global_rows(0))


def test_returned_rows_are_copies():
    plan = plans()[0]
    plan.global_rows(0)[:] = -1
    assert (plan.global_rows(0) >= 0).all()


def test_too_few_rows_is_a_clear_error():
    with pytest.raises(ValueError, match=r"only 10 rows of data for a global batch of 12 rows"):
        BatchPlan(num_rows=10, global_batch=12, micro_batch=2, grad_accum=3, dp_size=2)


def test_inconsistent_batch_arithmetic_is_shown():
    arithmetic = r"global_batch \(16\) != micro_batch \(2\) \* grad_accum \(3\) \* dp_size \(2\) = 12"
    with pytest.raises(ValueError, match=arithmetic):
        BatchPlan(num_rows=100, global_batch=16, micro_batch=2, grad_accum=3, dp_size=2)


def test_bad_rank_and_negative_step():
    with pytest.raises(ValueError, match=r"dp_rank \(2\) must be in \[0, dp_size=2\)"):
        BatchPlan(num_rows=100, global_batch=4, micro_batch=1, grad_accum=2, dp_rank=2, dp_size=2)
    with pytest.raises(ValueError, match="step must be >= 0"):
        plans()[0].global_rows(-1)
