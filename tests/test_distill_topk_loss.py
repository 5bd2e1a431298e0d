"""The top-k (+ tail) distillation loss (harness/distill/topk_loss.py) against a plain-torch float64 reference
written from the formulas (TRL 1.16's ServerDistillationTrainer: the support, the tail bucket, the generalised JSD),
in value and in the gradient of the student's logits, chunked and whole."""

from __future__ import annotations

import pytest
import torch

from harness.distill.topk import loss_positions, teacher_topk
from harness.distill.topk_loss import check_support, topk_loss_sum
from tests.helpers.topk_ref import topk_reference_sum

B, L, V = 3, 9, 37


def batch(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    student = torch.randn(B, L, V, generator=gen) * 2
    teacher = torch.randn(B, L, V, generator=gen) * 2
    labels = torch.randint(0, V, (B, L), generator=gen)
    labels[0, :4] = -100  # a prompt
    labels[1, 6:] = -100  # padding
    labels[2, ::3] = -100  # scattered
    return student, teacher, labels


CASES = [(0.0, 1), (0.0, 4), (0.5, 1), (1.0, 1)]


@pytest.mark.parametrize("beta,k", CASES)
@pytest.mark.parametrize("temperature", [1.0, 0.9])
@pytest.mark.parametrize("tail", [True, False])
def test_loss_and_gradient_equal_the_formula(beta, k, temperature, tail):
    student, teacher, labels = batch()
    targets = teacher_topk(teacher, labels, k, temperature, chunk_tokens=5)
    want_x = student.clone().double().requires_grad_()
    want = topk_reference_sum(want_x, teacher, labels, k, beta, temperature, tail)
    want.backward()
    for chunk in (4, 1024):  # chunked (and recomputed under checkpoint in the backward) and whole
        x = student.clone().requires_grad_()
        got = topk_loss_sum(x, labels, targets, beta=beta, temperature=temperature, add_tail=tail,
                            chunk_tokens=chunk)
        got.backward()
        assert got.dtype == torch.float32
        assert float(got.detach()) == pytest.approx(float(want.detach()), rel=1e-5, abs=1e-6)
        torch.testing.assert_close(x.grad.double(), want_x.grad, rtol=1e-4, atol=1e-6)
    # one bucket renormalised is 1 on both sides (why TRL adds the tail); every other case has a loss to learn from
    one_bucket = not tail and (beta == 1 or (beta == 0 and k == 1))
    assert (float(want.detach()) == 0) if one_bucket else float(want.detach()) > 0.01


def test_targets_are_the_teachers_top_k_at_the_temperature():
    _, teacher, labels = batch(1)
    got = teacher_topk(teacher, labels, 3, 0.9, chunk_tokens=2)
    rows, pos = loss_positions(labels)
    lp = torch.log_softmax(teacher[rows, pos] / 0.9, -1)
    torch.testing.assert_close(got.logps, lp.topk(3).values)
    assert torch.equal(got.ids, lp.topk(3).indices)
    torch.testing.assert_close(got.actual, lp.gather(-1, labels[:, 1:][rows, pos][:, None])[:, 0])
    assert got.ids.dtype == torch.int64 and got.logps.dtype == torch.float32
    assert len(got) == int((labels[:, 1:] != -100).sum())


def test_mixed_or_reverse_divergence_needs_top_1():
    with pytest.raises(ValueError, match=r"beta 0.5 > 0 needs k = 1 \(got k = 4\)"):
        check_support(0.5, 4)
    with pytest.raises(ValueError, match=r"beta 1.5 is outside \[0, 1\]"):
        check_support(1.5, 1)
    check_support(0.0, 8)
    student, teacher, labels = batch()
    short = teacher_topk(teacher[:, :, :], labels[:2], 1, 1.0)
    with pytest.raises(ValueError, match="targets for"):
        topk_loss_sum(student, labels, short, beta=0.0, temperature=1.0)


def test_the_ce_term_counts_the_tokens_it_is_given():
    """ce_alpha x the cross-entropy of the raw logits on ce_labels, none where a label is < 0 (a completion the
    student generated: harness/train/distill.py's ce_labels)."""
    from harness.distill.topk_loss import topk_rows_sum

    student, teacher, labels = batch(2)
    targets = teacher_topk(teacher, labels, 2, 0.9)
    rows, pos = loss_positions(labels)
    actual = labels[:, 1:][rows, pos]
    ce_labels = actual.clone()
    ce_labels[::2] = -1
    picked = torch.log_softmax(student[rows, pos].double(), -1).gather(-1, actual[:, None])[:, 0]
    want = topk_reference_sum(student, teacher, labels, 2, 0.0, 0.9, True) - 0.5 * picked[1::2].sum()
    got = topk_rows_sum(student[rows, pos], actual, targets, beta=0.0, temperature=0.9, ce_alpha=0.5,
                        ce_labels=ce_labels, chunk_tokens=3)[0]
    assert float(got) == pytest.approx(float(want), rel=1e-5)
