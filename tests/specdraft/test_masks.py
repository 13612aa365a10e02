"""Visibility grids against literal Python loops over DESIGN.md's index definitions."""

import itertools

import pytest
import torch

from specdraft import masks

T = 11


def w_loop(p: int, k: int, eps: int) -> int:
    return 0 if p < eps else eps + ((p - eps) // k) * k


@pytest.mark.parametrize("k,eps", [(1, 0), (3, 0), (3, 2), (5, 4)])
def test_window_start_and_position(k, eps):
    assert masks.window_start(T, k, eps).tolist() == [w_loop(p, k, eps) for p in range(T)]
    assert masks.window_position(T, k, eps).tolist() == [p - w_loop(p, k, eps) + 1 for p in range(T)]


def valid_rows():
    valid = torch.ones(2, T, dtype=torch.bool)
    valid[1, 8:] = False
    return valid


def test_plain_and_early_masks():
    valid = valid_rows()
    q, vis = masks.plain(valid)
    for b, p, u in itertools.product(range(2), range(T), range(T)):
        assert bool(vis[b, p, 0, u]) == (u < p and bool(valid[b, u]))
    for k, eps in [(4, 0), (4, 3)]:
        q, vis = masks.early(valid, k, eps)
        for b, p, u in itertools.product(range(2), range(T), range(T)):
            assert bool(vis[b, p, 0, u]) == (u < w_loop(p, k, eps) and bool(valid[b, u]))


@pytest.mark.parametrize("k,eps", [(3, 0), (4, 1)])
def test_late_step_masks(k, eps):
    valid = valid_rows()
    for i in range(1, k + 1):
        q, vis = masks.late_step(valid, k, eps, i)
        assert q.tolist() == [p for p in range(T) if p - w_loop(p, k, eps) + 1 == i]
        for b, (qi, p), u in itertools.product(range(2), enumerate(q.tolist()), range(T)):
            w = w_loop(p, k, eps)
            assert bool(vis[b, qi, 0, u]) == (u < w and bool(valid[b, u]))
            assert bool(vis[b, qi, 1, u]) == (w <= u < p and bool(valid[b, u]))


@pytest.mark.parametrize("j", [1, 2, 3, 4])
def test_align_step_masks(j):
    valid = valid_rows()
    q, vis = masks.align_step(valid, j)
    assert q.tolist() == list(range(j - 1, T))
    for b, (qi, p), v, c in itertools.product(range(2), enumerate(q.tolist()), range(j), range(T)):
        expected = c < p and v == max(0, c - p + j) and bool(valid[b, c])
        assert bool(vis[b, qi, v, c]) == expected
    # every state a query sees comes from exactly one version
    assert (vis.sum(2) <= 1).all()


def test_bad_window_arguments_are_rejected():
    with pytest.raises(AssertionError, match="eps"):
        masks.window_start(5, 3, 3)
    with pytest.raises(AssertionError, match="late step"):
        masks.late_step(valid_rows(), 3, 0, 4)
