"""observe_many leaves a histogram exactly as n plain observations would (the pump's ITL update)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram

from calserve.api.histograms import observe_many

_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 1.0)


def _samples(reg: CollectorRegistry) -> dict[tuple[str, str], float]:
    return {(s.name, s.labels.get("le", "")): s.value for m in reg.collect() for s in m.samples
            if not s.name.endswith("_created")}


@given(st.lists(st.tuples(st.sampled_from([0.0, 0.001, 0.003, 0.01, 0.07, 2.5]) | st.floats(0, 3),
                          st.integers(0, 20)), max_size=8))
def test_observe_many_equals_repeated_observe(obs: list[tuple[float, int]]) -> None:
    regs = CollectorRegistry(), CollectorRegistry()
    a, b = (Histogram("h", "h", ["m"], buckets=_BUCKETS, registry=r).labels("x") for r in regs)
    for amount, n in obs:
        for _ in range(n):
            a.observe(amount)
        observe_many(b, amount, n)
    sa, sb = _samples(regs[0]), _samples(regs[1])
    assert sa.keys() == sb.keys()
    for k in sa:
        assert abs(sa[k] - sb[k]) <= 1e-9 * max(1.0, abs(sa[k])), k


@given(st.lists(st.tuples(st.sampled_from([0.0, 0.001, 0.003, 0.01, 0.07, 2.5]) | st.floats(0, 3),
                          st.integers(0, 20)), max_size=8))
def test_many_observer_and_counter_inc_equal_the_plain_calls(obs: list[tuple[float, int]]) -> None:
    """The pump's per-stream ManyObserver (n = 1 included) and counter_inc leave the same samples
    as plain observe / inc calls."""
    from prometheus_client import Counter

    from calserve.api.histograms import ManyObserver, counter_inc

    regs = CollectorRegistry(), CollectorRegistry()
    (a, b), (ca, cb) = ((Histogram("h", "h", ["m"], buckets=_BUCKETS, registry=r).labels("x")
                         for r in regs),
                        (Counter("c", "c", ["m"], registry=r).labels("x") for r in regs))
    many, inc = ManyObserver(b), counter_inc(cb)
    for amount, n in obs:
        for _ in range(n):
            a.observe(amount)
        ca.inc(n)
        many.observe(amount, n)
        inc(n)
    sa, sb = _samples(regs[0]), _samples(regs[1])
    assert sa.keys() == sb.keys()
    for k in sa:
        assert abs(sa[k] - sb[k]) <= 1e-9 * max(1.0, abs(sa[k])), k
