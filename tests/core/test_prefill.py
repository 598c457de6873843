"""Prefill policy (spec §6, §17.1): size classes, and the round robin never starves long prefill."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from calserve.config import QueuesConfig
from calserve.core.prefill import QueueClass as Q
from calserve.core.prefill import ServiceRoundRobin, classify

CFG = QueuesConfig()


@pytest.mark.parametrize(("n", "q"), [(1, Q.SHORT), (512, Q.SHORT), (513, Q.MEDIUM),
                                      (4096, Q.MEDIUM), (4097, Q.LONG), (40_000, Q.LONG)])
def test_classify(n: int, q: Q) -> None:
    assert classify(n, CFG) is q


def test_default_pattern_is_8_4_2_1() -> None:
    rr = ServiceRoundRobin.from_config(CFG)
    picks = [rr.next(set(Q)) for _ in range(15 * 20)]
    assert {q: picks.count(q) for q in Q} == {Q.DECODE: 160, Q.SHORT: 80, Q.MEDIUM: 40, Q.LONG: 20}
    assert rr.statistics().picks[Q.LONG] == 20


def test_long_prefill_keeps_min_share_under_sustained_decode_and_short() -> None:
    """Decode and short queues never empty; one long prefill at a time arrives whenever the last
    one was served (the hardest case: long is often briefly empty). Long still gets >= 1/15."""
    rr = ServiceRoundRobin.from_config(CFG)
    long_waiting = True
    gaps, last = [], 0
    for i in range(1, 3001):
        avail = {Q.DECODE, Q.SHORT} | ({Q.LONG} if long_waiting else set())
        q = rr.next(avail)
        if q is Q.LONG:
            gaps.append(i - last)
            last = i
            long_waiting = False
        elif i % 3 == 0:
            long_waiting = True  # the next long request arrives shortly after
    assert len(gaps) >= 3000 // 15
    assert max(gaps) <= 16  # bounded wait: never starved


def test_empty_classes_are_skipped_and_nothing_gives_none() -> None:
    rr = ServiceRoundRobin.from_config(CFG)
    assert rr.next(set()) is None
    assert {rr.next({Q.MEDIUM}) for _ in range(5)} == {Q.MEDIUM}  # work-conserving


def test_bad_weights() -> None:
    with pytest.raises(ValueError, match="long"):
        ServiceRoundRobin({Q.DECODE: 1, Q.SHORT: 1, Q.MEDIUM: 1, Q.LONG: 0})


@given(
    weights=st.tuples(*[st.integers(1, 10)] * 4),
    avail_seq=st.lists(st.sets(st.sampled_from(list(Q)), min_size=1), min_size=1, max_size=200),
)
def test_continuously_available_class_gets_its_share(
    weights: tuple[int, int, int, int], avail_seq: list[set[Q]]
) -> None:
    """Property: a class available at every pick of a run of n picks gets at least
    floor(n * w / W_max) - 1 of them, W_max being the total weight of all classes."""
    w = dict(zip(Q, weights, strict=True))
    rr = ServiceRoundRobin(w)
    total = sum(weights)
    for q in Q:
        count = n = 0
        for avail in avail_seq:
            got = rr.next(avail | {q})
            assert got in avail | {q}
            n += 1
            count += got is q
        assert count >= (n * w[q]) // total - 1


def test_fair_prefill_pick_is_the_least_served_tenants_first_prompt() -> None:
    from calserve.core.prefill import fair_prefill_index

    queue = ["a", "a", "b", "c", "b"]
    assert fair_prefill_index(queue, {"a": 5.0, "b": 2.0, "c": 2.0}) == 2  # b's first (ties: queue order)
    assert fair_prefill_index(queue, {"a": 1.0, "b": 2.0, "c": 0.5}) == 3
    assert fair_prefill_index(queue, {"a": 1.0, "b": 2.0}) == 3  # c never served: counts as 0.0
    assert fair_prefill_index(["x"], {}) == 0


def _reference_next(weights: dict[Q, int], credit: dict[Q, int], available: set[Q]) -> Q | None:
    """The smooth weighted round robin as the class docstring states it, every class in order."""
    total = 0
    best: Q | None = None
    for c in Q:
        if c in available:
            credit[c] += weights[c]
            total += weights[c]
            if best is None or credit[c] > credit[best]:
                best = c
    if best is not None:
        credit[best] -= total
    return best


@given(st.lists(st.sets(st.sampled_from(list(Q))), max_size=60),
       st.lists(st.integers(1, 9), min_size=4, max_size=4))
def test_picks_match_the_stated_algorithm(picks: list[set[Q]], ws: list[int]) -> None:
    """Every pick (the one-class shortcut included) is the docstring's algorithm's, so are the
    credits after it (the shortcut leaves a lone class's credit as +w -w would); ``peek`` names
    the same class and changes nothing."""
    weights = dict(zip(Q, ws))
    rr = ServiceRoundRobin(weights)
    credit = {c: 0 for c in Q}
    counts = {c: 0 for c in Q}
    for available in picks:
        want = _reference_next(weights, credit, available)
        assert rr.peek(available) is want  # what the rotation asks: the pick, not granted
        assert rr.peek(available) is want
        assert rr.next(available) is want
        if want is not None:
            counts[want] += 1
        assert rr.statistics().picks == counts
    # the credits agree too: the same picks follow from any further available set
    for c in Q:
        assert rr.next({c, Q.DECODE}) is _reference_next(weights, credit, {c, Q.DECODE})
