"""The fused chunked head loss against the materialised formulas: values and gradients (fp32, 1e-5)."""

from __future__ import annotations

import pytest
import torch

from specdraft.losses import HeadTargets, head_loss, soft_ce, topk_ce

N, D, V, K = 37, 24, 113, 6


def reference(h, w, teacher_h, teacher_w, ids, logp, a, b):
    logq = torch.log_softmax(h @ w.T, -1)  # (N, V)
    ce = soft_ce(logq, teacher_h @ teacher_w.T)
    tk = topk_ce(logq, ids, logp)
    return (a * ce).sum() + (b * tk).sum(), ce, tk


def data(seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g)
    w = torch.randn(V, D, generator=g) / D**0.5
    teacher_h = torch.randn(N, D, generator=g)
    a = torch.rand(N, generator=g)
    b = torch.rand(N, generator=g)
    a[::5] = 0.0  # rows that are scored but not trained
    return h, w, teacher_h, a, b


@pytest.mark.parametrize("chunk", [1, 7, 1024])
def test_shared_frozen_head_matches_reference(chunk):
    h, w, teacher_h, a, b = data()
    zt = teacher_h @ w.T  # the teacher uses the same (frozen) head
    p = torch.softmax(zt, -1)
    top = torch.log_softmax(zt, -1).topk(K, dim=-1)
    targets = HeadTargets(
        top1=zt.argmax(-1), m_ce=p @ w, m_topk=torch.einsum("nk,nkd->nd", top.values.exp(), w[top.indices]),
        topk_mass=top.values.exp().sum(-1),
    )
    h1 = h.clone().requires_grad_()
    loss, ce, tk, correct = head_loss(h1, w, targets, a, b, chunk)
    loss.backward()
    h2 = h.clone().requires_grad_()
    ref, ref_ce, ref_tk = reference(h2, w, teacher_h, w, top.indices, top.values, a, b)
    ref.backward()
    # the summed loss is ~100: 1e-5 is one float32 ulp there, so its bound is relative (1e-6 of the value, a few ulps)
    assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-6)
    assert (ce - ref_ce).abs().max() < 1e-5 and (tk - ref_tk).abs().max() < 1e-5
    assert (h1.grad - h2.grad).abs().max() < 1e-5
    assert torch.equal(correct, (h @ w.T).argmax(-1) == zt.argmax(-1))


def teacher_targets(teacher_h, kept=False):
    """The own-head targets; ``kept``: with the teacher's distribution prepared (``teacher_p``), not recomputed."""
    teacher_w = torch.randn(V, D, generator=torch.Generator().manual_seed(2)) / D**0.5
    zt = teacher_h @ teacher_w.T
    top = torch.log_softmax(zt, -1).topk(K, dim=-1)
    targets = HeadTargets(top1=zt.argmax(-1), teacher_h=teacher_h, teacher_w=teacher_w,
                          teacher_lse=torch.logsumexp(zt, -1), topk_ids=top.indices, topk_logp=top.values,
                          teacher_p=torch.softmax(zt, -1) if kept else None)
    return targets, teacher_w, top


@pytest.mark.parametrize("kept", [False, True], ids=["teacher-recomputed", "teacher-kept"])
@pytest.mark.parametrize("defer", [False, True], ids=["weight-grad-forward", "weight-grad-deferred"])
@pytest.mark.parametrize("chunk", [3, 1024])
def test_trainable_head_with_teacher_rows_matches_reference(chunk, defer, kept):
    h, w, teacher_h, a, b = data(1)
    targets, teacher_w, top = teacher_targets(teacher_h, kept)
    h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss, ce, tk, _ = head_loss(h1, w1, targets, a, b, chunk, defer_weight_grad=defer)
    (2.0 * loss).backward()
    h2, w2 = h.clone().requires_grad_(), w.clone().requires_grad_()
    ref, ref_ce, ref_tk = reference(h2, w2, teacher_h, teacher_w, top.indices, top.values, a, b)
    (2.0 * ref).backward()
    # the summed loss is ~100: 1e-5 is one float32 ulp there, so its bound is relative (1e-6 of the value, a few ulps)
    assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-6)
    assert (ce - ref_ce).abs().max() < 1e-5 and (tk - ref_tk).abs().max() < 1e-5
    assert (h1.grad - h2.grad).abs().max() < 1e-5
    assert (w1.grad - w2.grad).abs().max() < 1e-5


def test_a_deferred_weight_gradient_is_not_kept_from_the_forward():
    """``defer_weight_grad`` (ttt's k forwards before one backward): no (V, d) gradient buffer is kept
    for the backward, only what the forward had already (the rows, the weight itself, d-wide rows)."""
    h, w, teacher_h, a, b = data(1)
    targets, _, _ = teacher_targets(teacher_h)
    kept = {}
    for defer in (False, True):
        sizes = []

        def pack(t, sizes=sizes):
            sizes.append(t.untyped_storage().nbytes() if t.untyped_storage().data_ptr() != w1.data_ptr() else 0)
            return t

        w1 = w.clone().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            head_loss(h.clone().requires_grad_(), w1, targets, a, b, 7, defer_weight_grad=defer)
        kept[defer] = sizes
    assert V * D * 4 in kept[False] and max(kept[True]) < V * D * 4, kept


def test_no_rows_gives_a_zero_loss_that_back_propagates():
    h = torch.zeros(0, D, requires_grad=True)
    targets = HeadTargets(top1=torch.zeros(0, dtype=torch.long), m_ce=torch.zeros(0, D))
    loss, ce, tk, correct = head_loss(h, torch.randn(V, D), targets, torch.zeros(0), torch.zeros(0))
    loss.backward()
    assert float(loss) == 0.0 and ce.numel() == tk.numel() == correct.numel() == 0


def test_trainable_head_without_teacher_rows_is_refused():
    h, w, teacher_h, a, b = data()
    targets = HeadTargets(top1=torch.zeros(N, dtype=torch.long), m_ce=torch.zeros(N, D))
    with pytest.raises(AssertionError, match="teacher"):
        head_loss(h, w.clone().requires_grad_(), targets, a, b)


def test_no_rows_still_reaches_a_trainable_head():
    """A rank without scored rows must still produce (zero) gradients for a trainable head, or
    distributed ranks disagree on which parameters have gradients."""
    w = torch.randn(V, D, requires_grad=True)
    targets = HeadTargets(top1=torch.zeros(0, dtype=torch.long), teacher_h=torch.zeros(0, D), teacher_w=w.detach(),
                          teacher_lse=torch.zeros(0))
    loss, *_ = head_loss(torch.zeros(0, D, requires_grad=True), w, targets, torch.zeros(0), torch.zeros(0))
    loss.backward()
    assert w.grad is not None and float(w.grad.abs().sum()) == 0.0


@pytest.mark.parametrize("index", [[4, 5, 6, 7], [2, 5, 6, 30], [9]], ids=["run", "gaps", "one"])
def test_rows_of_kept_teacher_targets_are_those_rows(index):
    """``HeadTargets.rows``: the rows asked for, whether they are a run (views, ``teacher_p`` not copied) or not."""
    targets, _, _ = teacher_targets(data(1)[2], kept=True)
    picked = targets.rows(torch.tensor(index))
    assert torch.equal(picked.teacher_p, targets.teacher_p[index]) and torch.equal(picked.top1, targets.top1[index])
    assert torch.equal(picked.teacher_h, targets.teacher_h[index]) and picked.teacher_w is targets.teacher_w
    is_view = picked.teacher_p.untyped_storage().data_ptr() == targets.teacher_p.untyped_storage().data_ptr()
    assert is_view == (index != [2, 5, 6, 30])
