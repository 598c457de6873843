"""``bench.http_floor.period_ratio``: with calserve's thread saturated, its CPU per event is its CPU
share of one stream's event period over the streams, so the grouped ratio to a floor sending the
same events follows from the period and the floor alone (bench/README, session 44)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, strategies as st

from bench.http_floor import CONCURRENCY, period_ratio


def _measured(cpu_s: float, wall_s: float, events: int, tokens: int) -> dict[str, float]:
    """The fields of ``http_floor.measure``'s result that the ratio reads, as it computes them."""
    return {"cpu_util": cpu_s / wall_s, "events_per_s": events / wall_s,
            "us_per_event": cpu_s / events * 1e6, "us_per_token": cpu_s / tokens * 1e6}


@given(cpu=st.floats(0.5, 8.0), wall=st.floats(1.0, 10.0), events=st.integers(1_000, 50_000),
       tpe=st.floats(1.0, 30.0), floor_us=st.floats(20.0, 300.0))
def test_the_period_gives_the_ratio_at_the_same_grouping(cpu: float, wall: float, events: int,
                                                        tpe: float, floor_us: float) -> None:
    """Exactly, given what ``measure`` reports: cpu_util * period / streams is CPU per event."""
    cal = _measured(cpu, wall, events, max(events, round(events * tpe)))
    got = period_ratio(cal, floor_us)
    assert got["stream_period_ms"] == pytest.approx(CONCURRENCY / cal["events_per_s"] * 1e3)
    assert got["ratio_from_period"] == pytest.approx(cal["us_per_event"] / floor_us, rel=1e-9)


def test_this_sessions_default_run() -> None:
    """This session's default run: 9.19 tokens an event, 2,555.55 events a second from 64 streams
    (a 25.0 ms period) at 98.5 % of a core; the floor 130.9 µs an event at that grouping flat out,
    170.2 at calserve's pace. Measured ratios 2.93 and 2.25 (the floors ran 9.1 tokens an event)."""
    cal = {"cpu_util": 0.985, "events_per_s": 2555.55}
    assert period_ratio(cal, 130.86)["stream_period_ms"] == pytest.approx(25.04, abs=0.01)
    assert period_ratio(cal, 130.86)["ratio_from_period"] == pytest.approx(2.95, abs=0.01)
    assert period_ratio(cal, 170.20)["ratio_from_period"] == pytest.approx(2.26, abs=0.01)


def test_no_events_is_an_infinite_period() -> None:
    got = period_ratio({"cpu_util": 0.0, "events_per_s": 0.0}, 100.0)
    assert math.isinf(got["stream_period_ms"])
