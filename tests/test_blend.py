"""The blend index of a mixture (harness/data/blend.py, mix_rows.py), in-process: every source's rows read stay
within one row of weight x rows read at every position, for every weight vector tried (exhaustively over small
integer weights, and random ones); the pattern's period; a resume's segments; the rows each step reads."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from harness.data.blend import Blend, Segment, build_pattern, integer_weights
from harness.data.mix_rows import MixPlan


def worst_error(ints: tuple[int, ...], periods: int = 2) -> float:
    """max over positions i and sources s of |count_s(i) - w_s * i| over `periods` periods."""
    blend = Blend([Segment(0, ints)])
    n = sum(ints) * periods
    ids, _ = blend.picks(0, n)
    counts = np.cumsum(np.eye(len(ints), dtype=np.int64)[ids], axis=0)  # after positions 1..n
    shares = np.asarray(ints, dtype=np.float64) / sum(ints)
    return float(np.abs(counts - np.arange(1, n + 1)[:, None] * shares).max())


def test_one_row_bound_exhaustive_small_weights():
    worst = max(worst_error(w) for k in (2, 3, 4) for w in itertools.product(range(1, 9 if k < 4 else 6), repeat=k))
    assert worst < 1, worst


def test_one_row_bound_random_and_skewed_weights():
    rng = random.Random(0)
    cases = [tuple(rng.randint(1, 60) for _ in range(rng.randint(2, 8))) for _ in range(300)]
    cases += [(1,) * 9 + (1000,), (1,) * 20 + (1000,), (999, 1, 1), (5, 3, 2), (2, 32, 6, 39, 2, 32)]
    worst = max(worst_error(w) for w in cases)
    assert worst < 1, worst


def test_megatron_greedy_would_miss_the_bound():
    """Why not Megatron's argmax(w (i + 1) - count): on these weights it leaves a source more than a row behind."""
    ints = (2, 32, 6, 39, 2, 32)  # found by a random search; 1.044 rows
    d, counts, worst = sum(ints), [0] * len(ints), 0.0
    for i in range(d):
        best = max(range(len(ints)), key=lambda s: (ints[s] * (i + 1) / d - counts[s], -s))
        counts[best] += 1
        worst = max(worst, max(abs(c - w * (i + 1) / d) for c, w in zip(counts, ints)))
    assert worst > 1 and worst_error(ints) < 1


def test_weights_exact_decimals_and_period():
    assert integer_weights([0.5, 0.3, 0.2]) == ((5, 3, 2), False)
    assert integer_weights([1, 1, 1]) == ((1, 1, 1), False)
    assert integer_weights([2.5, 7.5]) == ((1, 3), False)
    ints, rounded = integer_weights([0.1234567, 0.5])
    assert rounded and sum(ints) <= 10**6
    ids = build_pattern((5, 3, 2))
    assert np.bincount(ids).tolist() == [5, 3, 2]
    blend = Blend.of([0.5, 0.3, 0.2])
    assert blend.counts(10).tolist() == [5, 3, 2] and blend.counts(10_000_003).tolist() == [5_000_002, 3_000_001, 2_000_000]
    with pytest.raises(ValueError, match="positive"):
        integer_weights([0.5, 0.0])


def test_counts_equal_picks_and_k_is_running_count():
    blend = Blend.of([0.45, 0.35, 0.2])
    ids, ks = blend.picks(0, 500)
    for s in range(3):
        assert ks[ids == s].tolist() == list(range(int((ids == s).sum())))
    for pos in (0, 1, 19, 20, 137, 500):
        assert blend.counts(pos).tolist() == np.bincount(ids[:pos], minlength=3).tolist()
    ids2, ks2 = blend.picks(137, 300)  # any window agrees with the whole
    assert (ids2 == ids[137:300]).all() and (ks2 == ks[137:300]).all()


def test_reweighted_continues_counts_and_holds_the_bound_since():
    blend = Blend.of([0.5, 0.3, 0.2])
    at = 24
    new = blend.reweighted(at, [0.2, 0.3, 0.5])
    assert blend.reweighted(at, [5, 3, 2]) is blend  # same proportions: nothing changes
    assert (new.counts(at) == blend.counts(at)).all()
    ids, ks = new.picks(0, 400)
    old_ids, old_ks = blend.picks(0, at)
    assert (ids[:at] == old_ids).all() and (ks[:at] == old_ks).all()
    for s in range(3):  # k keeps counting up across the change
        assert ks[ids == s].tolist() == list(range(int((ids == s).sum())))
    since = np.cumsum(np.eye(3, dtype=np.int64)[ids[at:]], axis=0)
    shares = np.array([0.2, 0.3, 0.5])
    assert np.abs(since - np.arange(1, 400 - at + 1)[:, None] * shares).max() < 1
    again = Blend.from_state(new.state())
    assert (again.picks(0, 400)[0] == ids).all()


def test_plan_rows_epochs_and_ranks():
    sizes = (10, 7, 3)
    plan = MixPlan(sizes=sizes, blend=Blend.of([0.5, 0.3, 0.2]), global_batch=4, micro_batch=1, grad_accum=2,
                   dp_size=2, seed=3)
    offsets = np.cumsum((0,) + sizes)
    seen = [[] for _ in sizes]
    for step in range(30):
        rows = plan.global_rows(step).numpy()
        ranks = [np.concatenate([m.numpy() for m in MixPlan(**{**plan.__dict__, "dp_rank": r}).micro_batches(step)])
                 for r in range(2)]
        assert (np.concatenate(ranks) == rows).all()
        for r in rows:
            s = int(np.searchsorted(offsets, r, side="right") - 1)
            seen[s].append(int(r - offsets[s]))
    for s, n in enumerate(sizes):  # each epoch visits every row once, in a new order
        epochs = [seen[s][i:i + n] for i in range(0, len(seen[s]) - n + 1, n)]
        assert epochs and all(sorted(e) == list(range(n)) for e in epochs)
        if len(epochs) > 1:
            assert epochs[0] != epochs[1]
    assert plan.counts(30).tolist() == [60, 36, 24]
    assert plan.steps_per_epoch == 4  # the smallest source: 3 rows at 0.2 = 15 rows = 4 steps of 4


def test_counts_past_prefix_blocks_of_a_long_period():
    blend = Blend.of([0.4123, 0.3877, 0.2])  # a period of 10,000 positions: counts kept every 4,096
    assert sum(blend.segments[0].weights) == 10_000
    ids, ks = blend.picks(0, 25_000)
    for pos in (4095, 4096, 4097, 9_999, 10_000, 12_345, 24_999):
        assert blend.counts(pos).tolist() == np.bincount(ids[:pos], minlength=3).tolist()
    ids2, ks2 = blend.picks(8_190, 12_300)
    assert (ids2 == ids[8_190:12_300]).all() and (ks2 == ks[8_190:12_300]).all()


def test_token_sums_in_tiles_equal_the_whole_cross_entropy():
    """loss/<name>'s sums (harness/train/mixture.py): tiles of 2048 positions per row add up to the whole."""
    import torch

    from harness.train import mixture

    torch.manual_seed(0)
    logits, labels = torch.randn(3, 5000, 50), torch.randint(0, 50, (3, 5000))
    labels[1, :3000] = -100
    got = mixture.token_sums(logits, labels, np.array([1, 0, 1]), 2)
    whole = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 50), labels[:, 1:].reshape(-1),
                                              ignore_index=-100, reduction="none").view(3, -1).sum(1).double()
    assert torch.allclose(got[0], torch.stack([whole[1], whole[0] + whole[2]]), rtol=1e-6)
    assert got[1].tolist() == [2000, 9998] and got[2].tolist() == [1, 2]
