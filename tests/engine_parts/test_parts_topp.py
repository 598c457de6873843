"""The top-p cut of calserve.topp (ext/topp.c) against the numpy formulation, bit for bit.

``nucleus.cut`` zeroes the weights outside each row's top-p set in place; with the extension built
it must leave exactly what ``e * nucleus_mask(e, top_p, x)`` leaves (the same bucket masses, the
same cut, the same boundary ranking), for one row and for a batch, with ties, zero weights
(min-p), tiny and large top-p, vocabularies from 1 to SmolLM2's.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from calserve.engine import nucleus
from calserve.engine.sampler import _exp_shifted


def _weights(x: np.ndarray, temps: np.ndarray, min_p: np.ndarray) -> np.ndarray:
    e = _exp_shifted(x, temps).copy()
    nucleus.drop_below(e, min_p)
    return e


def _both(e: np.ndarray, top_p: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    want = e * nucleus.nucleus_mask(e.copy(), top_p, x)
    got = e.copy()
    nucleus.cut(got, top_p, x)
    return want, got


def test_the_extension_is_built() -> None:
    # the suite runs after build_ext (README, .ci/run): the comparisons below must not compare
    # the numpy fallback with itself
    assert nucleus.NATIVE


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 5), st.integers(1, 700),
       st.lists(st.sampled_from([1e-9, 1e-6, 0.1, 0.5, 0.9, 0.95, 0.999999, 1.0 - 2**-53]),
                min_size=5, max_size=5),
       st.sampled_from([0.01, 1.0, 3.0, 30.0, 300.0]), st.booleans(), st.floats(0.0, 0.9),
       st.integers(0, 2**32 - 1))
def test_cut_is_the_numpy_mask(m: int, v: int, tps: list[float], scale: float, ties: bool,
                               zeros: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((m, v)) * scale).astype(np.float32)
    if ties:
        x = np.round(x)
    temps = rng.choice([0.3, 0.7, 1.0, 1.5], size=m)
    e = _weights(x, temps, np.array([zeros / 2] + [0.0] * (m - 1)))
    top_p = np.array(tps[:m])
    want, got = _both(e, top_p, x)
    assert np.array_equal(want.view(np.uint64), got.view(np.uint64))
    # a lone row is cut as it is in the batch
    one = e[m - 1:].copy()
    nucleus.cut(one, top_p[m - 1:], x[m - 1:])
    assert np.array_equal(one[0].view(np.uint64), got[m - 1].view(np.uint64))


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.95])
def test_cut_on_a_49k_vocabulary(top_p: float) -> None:
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((16, 49152)) * 3).astype(np.float32)
    x[3, 100:200] = x[3].max()  # a row whose top is a hundred-way tie
    e = _weights(x, np.full(16, 0.7), np.zeros(16))
    want, got = _both(e, np.full(16, top_p), x)
    assert np.array_equal(want.view(np.uint64), got.view(np.uint64))
    assert (got > 0).sum(axis=1).min() >= 1


def test_weights_that_tie_where_the_logits_do_not() -> None:
    # exp of a difference below float64's resolution is 1.0: the higher logit ranks first
    x = np.array([[0.0, 2.8193624e-24], [2.8193624e-24, 0.0]], dtype=np.float32)
    e = _weights(x, np.ones(2), np.zeros(2))
    want, got = _both(e, np.array([0.4, 0.4]), x)
    assert np.array_equal(want, got) and got.tolist() == [[0.0, 1.0], [1.0, 0.0]]


def test_bad_buffers_are_refused() -> None:
    from calserve import topp

    e = np.ones((2, 4))
    ok = (np.ones(2), np.full(2, 0.5), np.empty(2), np.empty(2, np.int64), np.empty(8, np.int64))
    with pytest.raises(TypeError, match="e must be"):
        topp.cut(e.astype(np.float32), *ok)
    with pytest.raises(ValueError, match="shapes"):
        topp.cut(e, np.ones(3), *ok[1:])
    with pytest.raises(ValueError, match="shapes"):
        topp.cut(e, *ok[:4], np.empty(7, np.int64))
    with pytest.raises(TypeError, match="counts must be"):
        topp.cut(e, *ok[:3], np.empty(2), ok[4])


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 5), st.integers(1, 300), st.lists(st.floats(0.0, 1.0), min_size=5, max_size=5),
       st.integers(0, 2**32 - 1))
def test_drop_below_is_numpys_masked_copy(m: int, v: int, bounds: list[float], seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((m, v)) * 3).astype(np.float32)
    e = _weights(x, np.full(m, 0.8), np.zeros(m))
    min_p = np.array(bounds[:m])
    want = e.copy()
    np.copyto(want, 0.0, where=want < min_p[:, None])
    got = e.copy()
    nucleus.drop_below(got, min_p)
    assert np.array_equal(want.view(np.uint64), got.view(np.uint64))


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 5), st.integers(1, 200), st.integers(-2, 1), st.data())
def test_apply_masks_is_numpys_masked_copy(n: int, v: int, width: int, data: st.DataObject) -> None:
    """Grammar masks on logits: the extension's pass and numpy's unpackbits + masked copy ban the same
    tokens (masks as wide as the vocabulary, one word narrower or wider; words all set, none set, all
    but one bit, a few bits or random; every row or some)."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    x = rng.standard_normal((n, v)).astype(np.float32)
    nw = max(1, -(-v // 32) + width)
    rows = sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=1)))
    kinds = data.draw(st.lists(st.sampled_from(["random", "all", "none", "sparse", "all_but_one"]),
                               min_size=len(rows), max_size=len(rows)))
    masks = []
    for kind in kinds:
        if kind == "random":
            m = rng.integers(-2**31, 2**31 - 1, nw, dtype=np.int64).astype(np.int32)
        elif kind == "all_but_one":  # one token banned in each word
            m = np.full(nw, -1, np.int64)
            m ^= np.int64(1) << rng.integers(0, 32, nw)
            m = (m & 0xFFFFFFFF).astype(np.uint32).view(np.int32)
        elif kind == "sparse":
            m = np.zeros(nw, np.int32)
            m[rng.integers(0, nw, 3)] = np.int32(1 << int(rng.integers(0, 31)))
        else:
            m = np.full(nw, -1 if kind == "all" else 0, np.int32)
        masks.append(m)
    got = x.copy()
    nucleus.apply_masks(got, rows, masks)
    want = x.copy()
    saved = nucleus._ext
    try:
        nucleus._ext = None  # the numpy formulation
        nucleus.apply_masks(want, rows, masks)
    finally:
        nucleus._ext = saved
    assert np.array_equal(want.view(np.uint32), got.view(np.uint32))
