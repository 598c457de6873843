"""Properties of calserve.engine.sampler.sample_batch (issue 5 item 5).

The reference below is a deliberately naive per-lane loop (full stable sort, float64), so the
vectorised implementation is checked against an independent formulation of the same rules.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from calserve.engine.sampler import LaneSampling, resolve_seed, sample_batch, uniform_for
from calserve.engine.types import SamplingParams

# Small-integer logits make ties frequent, which is where tie-breaking bugs hide.
_small_vals = st.integers(-4, 4).map(float)
_wide_vals = st.floats(-30.0, 30.0, allow_nan=False, width=32)


@st.composite
def logits_matrix(draw: st.DrawFn, max_rows: int = 6, max_vocab: int = 80) -> np.ndarray:
    n = draw(st.integers(1, max_rows))
    v = draw(st.integers(1, max_vocab))
    elem = draw(st.sampled_from([_small_vals, _wide_vals, st.one_of(_small_vals, _wide_vals)]))
    vals = draw(st.lists(elem, min_size=n * v, max_size=n * v))
    return np.asarray(vals, dtype=np.float32).reshape(n, v)


lane_strategy = st.builds(
    LaneSampling,
    temperature=st.sampled_from([0.0, 0.3, 0.7, 1.0, 1.5]),
    top_p=st.sampled_from([1.0, 0.95, 0.5, 0.1, 1e-6]),
    top_k=st.sampled_from([0, 1, 2, 5, 50]),
    seed=st.integers(0, 2**64 - 1),
    step=st.integers(0, 10_000),
    logprobs=st.sampled_from([None, 0, 1, 5]),
)


def _order(row: np.ndarray) -> np.ndarray:
    """Ids by (logit desc, id asc)."""
    return np.argsort(-row.astype(np.float64), kind="stable")


def _allowed_set(row: np.ndarray, lane: LaneSampling) -> list[int]:
    """Tokens the rules allow for a non-greedy lane, in (prob desc, id asc) order, with their
    renormalised probabilities."""
    v = row.shape[0]
    order = _order(row)
    s = row.astype(np.float64) / lane.temperature
    p_full = np.exp(s - s.max())
    p_full /= p_full.sum()
    k = lane.top_k if 0 < lane.top_k < v else v
    cand = order[:k]
    p = p_full[cand]
    if lane.top_k > 0:
        p = p / p.sum()
    excl = np.cumsum(p) - p
    keep = (excl < lane.top_p) & (p > 0)
    keep[0] = True
    return [int(t) for t in cand[keep]]


def _reference(row: np.ndarray, lane: LaneSampling) -> int:
    if lane.temperature == 0:
        return int(np.argmax(row))
    assert lane.seed is not None
    u = uniform_for(lane.seed, lane.step)
    v = row.shape[0]
    truncated = (0 < lane.top_k < v) or lane.top_p < 1.0
    s = row.astype(np.float64) / lane.temperature
    if not truncated:
        e = np.exp(s - s.max())
        cdf = np.cumsum(e)
        i = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
        return min(i, int(np.flatnonzero(e > 0)[-1]))
    allowed = sorted(_allowed_set(row, lane))  # drawn in token-id order, like the full path
    e = np.exp(s[allowed] - s.max())
    cdf = np.cumsum(e)
    i = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    return allowed[min(i, len(allowed) - 1)]


@given(logits_matrix())
def test_greedy_is_argmax_lowest_id_on_ties(x: np.ndarray) -> None:
    res = sample_batch(x, [LaneSampling(temperature=0.0)] * x.shape[0])
    assert res.tokens.dtype == np.int64
    for i, row in enumerate(x):
        t = int(res.tokens[i])
        assert row[t] == row.max()
        assert t == int(np.flatnonzero(row == row.max())[0])
    assert res.logprobs == [None] * x.shape[0]


@given(st.data())
def test_matches_naive_reference_and_stays_in_allowed_set(data: st.DataObject) -> None:
    x = data.draw(logits_matrix())
    lanes = data.draw(st.lists(lane_strategy, min_size=x.shape[0], max_size=x.shape[0]))
    res = sample_batch(x, lanes)
    for i, lane in enumerate(lanes):
        t = int(res.tokens[i])
        assert 0 <= t < x.shape[1]
        if lane.temperature > 0:
            assert t in _allowed_set(x[i], lane), (i, lane)
        assert t == _reference(x[i], lane), (i, lane)


@given(st.data())
def test_top_k_one_and_tiny_top_p_are_greedy(data: st.DataObject) -> None:
    x = data.draw(logits_matrix())
    n = x.shape[0]
    seeds = data.draw(st.lists(st.integers(0, 2**63), min_size=n, max_size=n))
    greedy = sample_batch(x, [LaneSampling()] * n).tokens
    k1 = sample_batch(x, [LaneSampling(temperature=1.0, top_k=1, seed=s) for s in seeds]).tokens
    p0 = sample_batch(x, [LaneSampling(temperature=1.0, top_p=1e-9, seed=s) for s in seeds]).tokens
    assert k1.tolist() == greedy.tolist()
    assert p0.tolist() == greedy.tolist()


@pytest.mark.parametrize("top_p", [1e-9, 0.4])
def test_top_p_ranks_by_logit_where_the_weights_tie(top_p: float) -> None:
    # exp(2.8e-24 - 2.8e-24) and exp(0 - 2.8e-24) are both 1.0 in float64: the weights tie, the
    # logits do not. A tiny top-p keeps the higher logit alone (= greedy), whatever the seed, and
    # so does any top-p below one half (found by a random-seed hypothesis run).
    x = np.array([[0.0, 2.8193624e-24], [2.8193624e-24, 0.0]], dtype=np.float32)
    for seed in range(20):
        lanes = [LaneSampling(temperature=1.0, top_p=top_p, seed=seed)] * 2
        assert sample_batch(x, lanes).tokens.tolist() == [1, 0]
        assert [_reference(row, ln) for row, ln in zip(x, lanes)] == [1, 0]


@given(st.data())
def test_seeded_lane_independent_of_batch_position_and_mates(data: st.DataObject) -> None:
    v = data.draw(st.integers(2, 300))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32)))
    row = (rng.standard_normal(v) * data.draw(st.sampled_from([0.5, 3.0]))).astype(np.float32)
    lane = data.draw(lane_strategy.filter(lambda ln: ln.temperature > 0))
    solo = sample_batch(row[None, :], [lane])
    mates = data.draw(st.lists(lane_strategy, min_size=0, max_size=7))
    pos = data.draw(st.integers(0, len(mates)))
    lanes = [*mates[:pos], lane, *mates[pos:]]
    x = rng.standard_normal((len(lanes), v)).astype(np.float32)
    x[pos] = row
    res = sample_batch(x, lanes)
    assert int(res.tokens[pos]) == int(solo.tokens[0])
    assert res.logprobs[pos] == solo.logprobs[0]


@given(st.data())
def test_logprobs_are_log_softmax_of_raw_logits_and_ignore_temperature(data: st.DataObject) -> None:
    x = data.draw(logits_matrix())
    lanes = data.draw(st.lists(lane_strategy, min_size=x.shape[0], max_size=x.shape[0]))
    lanes = [dataclasses.replace(ln, logprobs=data.draw(st.integers(0, 6))) for ln in lanes]
    res = sample_batch(x, lanes)
    for i, lane in enumerate(lanes):
        row = x[i].astype(np.float64)
        lsm = row - row.max() - np.log(np.exp(row - row.max()).sum())
        lp = res.logprobs[i]
        assert lp is not None
        assert lp.token_id == int(res.tokens[i])
        assert lp.logprob == pytest.approx(lsm[lp.token_id], abs=1e-9)
        k = min(lane.logprobs or 0, x.shape[1])
        expect_ids = _order(x[i])[:k].tolist()
        assert [t for t, _ in lp.top] == expect_ids
        assert [v for _, v in lp.top] == pytest.approx(lsm[expect_ids].tolist(), abs=1e-9)
        # Temperature (and truncation) change the choice, never the reported logprobs.
        hot = sample_batch(x[i : i + 1], [dataclasses.replace(lane, temperature=0.0)]).logprobs[0]
        assert hot is not None and hot.top == lp.top


def test_sampling_frequencies_follow_softmax_over_temperature() -> None:
    x = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0], dtype=np.float32)
    n = 20_000
    temp = 0.8
    res = sample_batch(np.tile(x, (n, 1)), [LaneSampling(temperature=temp, seed=s, step=3) for s in range(n)])
    counts = np.bincount(res.tokens, minlength=x.size)
    p = np.exp(x / temp - (x / temp).max())
    p /= p.sum()
    sigma = np.sqrt(n * p * (1 - p))
    assert np.all(np.abs(counts - n * p) < 5 * sigma + 1), (counts, n * p)


def test_top_p_frequencies_follow_renormalised_nucleus() -> None:
    x = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float64)).astype(np.float32)
    n = 20_000
    res = sample_batch(np.tile(x, (n, 1)), [LaneSampling(temperature=1.0, top_p=0.8, seed=s) for s in range(n)])
    counts = np.bincount(res.tokens, minlength=4)
    # exclusive cumsum: 0, .5, .8, .95 -> keep tokens 0 and 1 only (0.8 is not < 0.8).
    assert counts[2] == counts[3] == 0
    assert abs(counts[0] / n - 0.625) < 0.02


def test_nucleus_on_flat_rows_with_big_boundary_buckets() -> None:
    # 4096 nearly equal logits: the 0.9 nucleus holds ~3700 tokens, many in the boundary bucket.
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((3, 4096)) * 0.01).astype(np.float32)
    lanes = [LaneSampling(temperature=1.0, top_p=0.9, seed=s) for s in (5, 6, 7)]
    res = sample_batch(x, lanes)
    for i, lane in enumerate(lanes):
        assert int(res.tokens[i]) == _reference(x[i], lane)


def test_unseeded_lanes_still_sample_in_range() -> None:
    x = np.zeros((4, 10), dtype=np.float32)
    res = sample_batch(x, [LaneSampling(temperature=1.0)] * 4)
    assert all(0 <= t < 10 for t in res.tokens.tolist())
    assert isinstance(resolve_seed(None), int) and resolve_seed(7) == 7


def test_uniforms_are_counter_based() -> None:
    us = [uniform_for(s, t) for s in range(50) for t in range(50)]
    assert all(0.0 <= u < 1.0 for u in us)
    assert len(set(us)) == len(us)
    assert uniform_for(123, 4) == uniform_for(123, 4)
    assert uniform_for(-1, 0) == uniform_for(2**64 - 1, 0)  # seeds are taken mod 2**64


def test_from_params() -> None:
    sp = SamplingParams(temperature=0.5, top_p=0.9, top_k=3, seed=11, logprobs=2)
    ln = LaneSampling.from_params(sp, step=4)
    assert (ln.temperature, ln.top_p, ln.top_k, ln.seed, ln.step, ln.logprobs) == (0.5, 0.9, 3, 11, 4, 2)
    assert LaneSampling.from_params(sp, step=0, seed=99).seed == 99


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"step": -1}, "step"),
        ({"logprobs": -2}, "logprobs"),
    ],
)
def test_lane_validation_names_the_field(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        LaneSampling(**kwargs)  # type: ignore[arg-type]


def test_bad_logits_are_rejected_naming_the_lane() -> None:
    x = np.zeros((3, 5), dtype=np.float32)
    x[1, 2] = np.nan
    with pytest.raises(ValueError, match="lane 1"):
        sample_batch(x, [LaneSampling()] * 3)
    y = np.full((2, 5), -np.inf, dtype=np.float32)
    y[0, 0] = 0.0
    with pytest.raises(ValueError, match="lane 1"):
        sample_batch(y, [LaneSampling(temperature=1.0, seed=1)] * 2)
    with pytest.raises(ValueError, match="rows"):
        sample_batch(np.zeros((2, 5), np.float32), [LaneSampling()])
    with pytest.raises(ValueError, match="2-D"):
        sample_batch(np.zeros(5, np.float32), [LaneSampling()])


def test_masked_minus_inf_tokens_are_never_drawn() -> None:
    x = np.full((200, 6), -np.inf, dtype=np.float32)
    x[:, 1] = 0.0
    x[:, 4] = 0.5
    lanes = [LaneSampling(temperature=2.0, seed=s, top_k=(s % 3) * 3, top_p=1.0 if s % 2 else 0.99) for s in range(200)]
    res = sample_batch(x, lanes)
    assert set(res.tokens.tolist()) <= {1, 4}
    assert set(res.tokens.tolist()) == {1, 4}


@given(logits_matrix(), st.data())
def test_greedy_fast_path_equals_general_path(x: np.ndarray, data: st.DataObject) -> None:
    """All-greedy batches without logprobs take a fast path; a greedy lane asking for logprobs
    goes through the general one. Tokens must not depend on which path ran, and rows with NaN,
    +inf or no finite value are rejected by both, naming the same (first) lane."""
    n = x.shape[0]
    bad = data.draw(st.lists(st.sampled_from(["nan", "inf", "-inf_row"]), max_size=n))
    for i, kind in enumerate(bad):
        if kind == "nan":
            x[i, data.draw(st.integers(0, x.shape[1] - 1))] = np.nan
        elif kind == "inf":
            x[i, data.draw(st.integers(0, x.shape[1] - 1))] = np.inf
        else:
            x[i, :] = -np.inf
    fast_lanes = [LaneSampling()] * n
    general_lanes = [LaneSampling(logprobs=0)] * n
    if bad:
        with pytest.raises(ValueError, match="lane 0"):
            sample_batch(x, fast_lanes)
        with pytest.raises(ValueError, match="lane 0"):
            sample_batch(x, general_lanes)
        return
    fast = sample_batch(x, fast_lanes)
    general = sample_batch(x, general_lanes)
    assert fast.tokens.dtype == np.int64
    assert fast.tokens.tolist() == general.tokens.tolist()
    assert fast.logprobs == [None] * n


@given(st.integers(1, 20), st.integers(1, 300), st.floats(0.0, 1.0), st.integers(0, 2**32 - 1))
def test_flat_nonzero_is_numpys_2d_nonzero(m: int, v: int, density: float, seed: int) -> None:
    """The sampler's 2-D nonzero (flat indices split by the row length) gives numpy's arrays."""
    from calserve.engine.nucleus import nonzero2 as _nonzero2
    mask = np.random.default_rng(seed).random((m, v)) < density
    want, got = np.nonzero(mask), _nonzero2(mask)
    for w, g in zip(want, got, strict=True):
        assert g.dtype == w.dtype and np.array_equal(g, w)


@given(logits_matrix(max_rows=5, max_vocab=120), st.integers(1, 130))
def test_block_max_is_the_padded_blocks_max(x: np.ndarray, block: int) -> None:
    from calserve.engine.sampler import _block_max, _pad_blocks
    x[:, ::3] = -np.inf  # masked tokens (a grammar, a -100 bias)
    want = _pad_blocks(x, block, -np.inf).max(axis=2)
    got = _block_max(x, block)
    assert got.shape == want.shape and np.array_equal(got, want)


@given(st.data())
def test_a_batch_of_one_kind_draws_what_a_mixed_batch_draws(data: st.DataObject) -> None:
    """Lanes that are all of one kind (full vocabulary, top-k, top-p) take their rows as a view;
    beside a greedy mate they take them by index: the same tokens and logprobs either way."""
    x = data.draw(logits_matrix(max_rows=5, max_vocab=200))
    n = x.shape[0]
    kind = data.draw(st.sampled_from([{}, {"top_k": 5}, {"top_p": 0.5}, {"min_p": 0.2}]))
    lanes = [LaneSampling(temperature=data.draw(st.sampled_from([0.5, 1.0, 1.3])), seed=s, step=3,
                          logprobs=data.draw(st.sampled_from([None, 2])), **kind)
             for s in data.draw(st.lists(st.integers(0, 2**63), min_size=n, max_size=n))]
    alone = sample_batch(x, lanes)
    mixed = sample_batch(np.concatenate([x, x[:1]]), [*lanes, LaneSampling()])
    assert alone.tokens.tolist() == mixed.tokens[:n].tolist()
    assert alone.logprobs == mixed.logprobs[:n]


def _np_uniform(seed: int, step: int) -> float:
    """The counter-based uniform computed as numpy uint64 array arithmetic (how the sampler
    computed it before it moved to Python ints): the draws must not change."""
    m = (1 << 64) - 1

    def mix(x: np.ndarray) -> np.ndarray:
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))

    s = np.array([seed & m], dtype=np.uint64)
    t = np.array([step & m], dtype=np.uint64)
    h = mix(s ^ mix(t))
    return float((h >> np.uint64(11)).astype(np.float64)[0] * (1.0 / (1 << 53)))


@given(st.integers(-(2**70), 2**70), st.integers(0, 2**66))
def test_uniform_is_the_uint64_splitmix(seed: int, step: int) -> None:
    assert uniform_for(seed, step) == _np_uniform(seed, step)


def test_scratch_buffers_are_per_use_and_width_and_leave_no_trace() -> None:
    """The sampler's scratch: a smaller batch gets the first rows of the largest so far (C
    contiguous), another width or use its own buffer; and a batch draws the same after any other
    batch as in a fresh thread."""
    import threading

    from calserve.engine.nucleus import scratch as _scratch

    big = _scratch((16, 1000), np.float64, "t-weights")
    small = _scratch((3, 1000), np.float64, "t-weights")
    assert small.shape == (3, 1000) and small.flags.c_contiguous
    assert np.shares_memory(big, small)
    assert not np.shares_memory(big, _scratch((3, 1000), np.float64, "t-other"))
    assert not np.shares_memory(big, _scratch((3, 999), np.float64, "t-weights"))

    rng = np.random.default_rng(5)
    lanes = [LaneSampling(temperature=0.8, top_p=p, seed=i, step=7, min_p=mp)
             for i, (p, mp) in enumerate([(1.0, 0.0), (0.9, 0.0), (1.0, 0.1)])]
    x = (rng.standard_normal((3, 700)) * 3).astype(np.float32)
    fresh: list[list[int]] = []
    t = threading.Thread(target=lambda: fresh.append(sample_batch(x, lanes).tokens.tolist()))
    t.start()
    t.join()
    for n in (16, 1, 3, 9):  # other batches in between leave other contents in the buffers
        other = (rng.standard_normal((n, 700)) * 5).astype(np.float32)
        sample_batch(other, [LaneSampling(temperature=1.3, top_p=0.5, seed=99, step=n)] * n)
        assert sample_batch(x, lanes).tokens.tolist() == fresh[0]


@given(st.integers(1, 700), st.floats(0.0, 0.999999), st.floats(0.0, 0.9), st.integers(0, 2**32 - 1))
def test_one_row_draw_is_the_batch_draw(v: int, u: float, zeros: float, seed: int) -> None:
    """A lone row (the default configuration's every sampled token) takes its own draw: the
    same token as the batch's draw of that row beside another."""
    from calserve.engine.sampler import _draw_id_order

    rng = np.random.default_rng(seed)
    e = np.exp(rng.standard_normal((2, v)) * rng.choice([0.1, 3.0, 30.0]))
    e[rng.random((2, v)) < zeros] = 0.0  # masked (top-p, min-p, a grammar)
    e[:, int(rng.integers(0, v))] = 1.0  # some positive weight in every row
    us = np.array([u, 0.5])
    assert _draw_id_order(e[:1], us[:1]).tolist() == _draw_id_order(e, us)[:1].tolist()


@given(st.integers(1, 600), st.sampled_from([1e-6, 0.1, 0.5, 0.9, 0.95, 0.999999]),
       st.floats(0.0, 0.9), st.booleans(), st.integers(0, 2**32 - 1))
def test_one_row_nucleus_is_the_batch_nucleus(v: int, top_p: float, zeros: float, ties: bool,
                                             seed: int) -> None:
    """A lone row's top-p set (the default configuration's every top-p token) is the batch's set
    of that row beside another: same buckets, same cut, same ranking by logit and id."""
    from calserve.engine.nucleus import drop_below
    from calserve.engine.nucleus import nucleus_mask as _nucleus_mask
    from calserve.engine.sampler import _exp_shifted

    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((2, v)) * rng.choice([0.01, 1.0, 3.0, 30.0])).astype(np.float32)
    if ties:
        x = np.round(x)
    e = _exp_shifted(x, np.array([0.7, 1.3])).copy()
    drop_below(e, np.array([zeros / 2, 0.0]))  # min-p zeros in the first row
    tp = np.array([top_p, 0.5])
    one = _nucleus_mask(e[:1].copy(), tp[:1], x[:1])
    both = _nucleus_mask(e.copy(), tp, x)
    assert one.shape == (1, v) and np.array_equal(one[0], both[0])


@given(st.data())
def test_temperature_one_logprobs_from_the_draws_weights_are_the_computed_ones(data: st.DataObject) -> None:
    """Lanes at temperature 1 over the full vocabulary take the softmax normaliser of their logprobs
    from the draw's weights; beside a lane that needs them computed (another temperature), all are
    computed: the logprobs are the same bits either way, and so are the tokens."""
    x = data.draw(logits_matrix(max_rows=4, max_vocab=300))
    n = x.shape[0]
    seeds = data.draw(st.lists(st.integers(0, 2**63), min_size=n, max_size=n))
    k = data.draw(st.sampled_from([0, 3]))
    lanes = [LaneSampling(temperature=1.0, seed=s, step=5, logprobs=k) for s in seeds]
    reused = sample_batch(x, lanes)
    mate = LaneSampling(temperature=0.7, seed=1, logprobs=0)
    computed = sample_batch(np.concatenate([x, x[:1]]), [*lanes, mate])
    assert reused.tokens.tolist() == computed.tokens[:n].tolist()
    assert reused.logprobs == computed.logprobs[:n]
    for lp, row in zip(reused.logprobs, x, strict=True):
        assert lp is not None
        lse = float(np.log(np.exp(row.astype(np.float64) - row.max()).sum()) + row.max())
        assert lp.logprob == pytest.approx(float(row[lp.token_id]) - lse, abs=1e-9)
