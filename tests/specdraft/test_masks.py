"""Sub-step descriptions against literal Python loops over the index definitions in specdraft/masks.py.

``Step.versions`` expands a sub-step into "which version of state u does query p see"
(0 true, v = the draft's state written at sub-step v, -1 hidden); each stage's rule is
checked against the definition written out as a loop.
"""

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


def test_plain_and_early():
    st = masks.plain(T)
    assert st.query_index.tolist() == list(range(T)) and st.extras == 0
    for (qi, p), u in itertools.product(enumerate(range(T)), range(T)):
        assert int(st.versions(T)[qi, u]) == (0 if u < p else -1)
    for k, eps in [(4, 0), (4, 3)]:
        st = masks.early(T, k, eps)
        ver = st.versions(T)
        for p, u in itertools.product(range(T), range(T)):
            assert int(ver[p, u]) == (0 if u < w_loop(p, k, eps) else -1)


@pytest.mark.parametrize("k,eps", [(3, 0), (4, 1)])
def test_late_steps(k, eps):
    for i in range(1, k + 1):
        st = masks.late_step(T, k, eps, i)
        assert st.weight == k - i + 1
        assert st.query_index.tolist() == [p for p in range(T) if p - w_loop(p, k, eps) + 1 == i]
        ver = st.versions(T)
        for (qi, p), u in itertools.product(enumerate(st.query_index.tolist()), range(T)):
            w = w_loop(p, k, eps)
            # true before the window; inside it the draft state written at window position u - w + 1
            expected = 0 if u < w else (u - w + 1 if u < p else -1)
            assert int(ver[qi, u]) == expected


@pytest.mark.parametrize("j", [1, 2, 3, 4])
def test_align_steps(j):
    st = masks.align_step(T, j, decay=0.5)
    assert st.query_index.tolist() == list(range(j - 1, T)) and st.weight == 0.5 ** (j - 1)
    ver = st.versions(T)
    for (qi, p), u in itertools.product(enumerate(st.query_index.tolist()), range(T)):
        expected = max(0, u - p + j) if u < p else -1
        assert int(ver[qi, u]) == expected


def test_bad_window_arguments_are_rejected():
    with pytest.raises(AssertionError, match="eps"):
        masks.window_start(5, 3, 3)
    with pytest.raises(AssertionError, match="late step"):
        masks.late_step(T, 3, 0, 4)
