"""Adaptive stream grouping (calserve/api/pacing.py): streams hold their next chunk only while the
serving thread is saturated; fixed ``server.stream_interval_ms`` overrides it; the first token is
never held and nothing is lost either way."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from calserve.api.app import get_state
from calserve.api.pacing import RELEASE_RATIO, StreamPacer, thread_demand_s

from .conftest import make_config
from .sse_util import parse_sse, stream_post
from .test_stream_chunks import C, chunk_texts, gen_text


class FakeTimes:
    """A wall clock and a thread CPU clock the test drives."""

    def __init__(self) -> None:
        self.wall = 0.0
        self.cpu = 0.0

    def run(self, dt: float, busy: float) -> None:
        self.wall += dt
        self.cpu += dt * busy


def pacer(t: FakeTimes, **kw: Any) -> StreamPacer:
    kw.setdefault("busy_s", 0.02)
    return StreamPacer(clock=lambda: t.wall, cpu=lambda: t.cpu, **kw)


def test_engages_when_saturated_and_releases_with_hysteresis() -> None:
    t = FakeTimes()
    p = pacer(t, busy_fraction=0.9)
    t.run(0.05, 1.0)
    assert p.interval() == 0.0  # the window (100 ms) is not over yet
    t.run(0.05, 1.0)
    assert p.interval() == 0.02 and p.engaged and p.engagements == 1
    t.run(0.1, 0.7)  # below the engage threshold, above the release one (0.63): stays
    assert p.interval() == 0.02
    t.run(0.1, 0.6)
    assert p.interval() == 0.0 and not p.engaged
    t.run(0.1, 0.85)  # below the engage threshold: stays off
    assert p.interval() == 0.0
    t.run(1.0, 0.95)
    assert p.interval() == 0.02 and p.engagements == 2


def test_idle_gap_releases_on_the_next_call() -> None:
    t = FakeTimes()
    p = pacer(t)
    t.run(0.2, 1.0)
    assert p.interval() == 0.02
    t.run(0.1, 1.0)
    t.run(5.0, 0.0)  # no stream called for 5 s: one long window, mostly idle
    assert p.interval() == 0.0


def test_fixed_interval_and_off() -> None:
    t = FakeTimes()
    fixed = pacer(t, fixed_s=0.05)
    off = pacer(t, busy_s=0.0)
    t.run(1.0, 1.0)
    assert fixed.interval() == 0.05 and off.interval() == 0.0
    t.run(1.0, 0.0)
    assert fixed.interval() == 0.05 and off.interval() == 0.0
    with pytest.raises(ValueError):
        StreamPacer(busy_fraction=0.0)


@given(st.lists(st.tuples(st.floats(0.0, 0.5), st.floats(0.0, 1.0)), max_size=60),
       st.floats(0.05, 1.0))
def test_hysteresis_property(steps: list[tuple[float, float]], threshold: float) -> None:
    """The interval is 0 or the busy interval; it switches on only after a window at or above the
    threshold and off only after one below RELEASE_RATIO of it."""
    t = FakeTimes()
    p = pacer(t, busy_fraction=threshold)
    was = False
    for dt, busy in steps:
        t.run(dt, busy)
        iv = p.interval()
        assert iv in (0.0, 0.02)
        now_on = iv == 0.02
        if now_on != was:  # a window closed and crossed the band
            if now_on:
                assert p.busy_fraction >= threshold
            else:
                assert p.busy_fraction < threshold * RELEASE_RATIO
        was = now_on


@pytest.mark.parametrize("busy", [True, False], ids=["saturated", "idle"])
async def test_streams_group_tokens_only_while_saturated(
    harness_factory: Any, autojump_clock: Any, busy: bool
) -> None:
    n = 40  # the fake engine makes one token per 10 ms (trio time)
    cfg = make_config(server={"stream_busy_interval_ms": 50})
    async with harness_factory(cfg, token_delay=0.01, coalesce=True) as h:
        t = FakeTimes()
        state = get_state(h.app)
        # The pacer's clocks are real ones in production; here every call is one more window.
        timer = state.holds  # the app's (started with it): the holds go through it
        assert timer.running
        p = state._pacer = StreamPacer(0.0, 0.05, 0.9, window_s=1e-9,
                                       clock=lambda: t.wall, cpu=lambda: t.cpu, timer=timer)

        def tick_clock() -> float:
            t.run(0.1, 1.0 if busy else 0.1)
            return t.wall

        p._clock = tick_clock  # type: ignore[assignment]
        status, raw = await stream_post(h.client, C, {"prompt": "slow", "max_tokens": n,
                                                      "stream": True})
        text = await (await h.client.get("/metrics")).get_data(as_text=True)
        assert f"calserve_stream_grouping {1.0 if busy else 0.0}" in text
        # the hold timer's counters (no idle wake-up measured under the fake clock: none early)
        assert f"calserve_stream_holds_total {float(timer.holds)}" in text
        assert "calserve_stream_holds_coalesced_total 0.0" in text
        assert (timer.holds > 0) == busy
    assert status == 200
    events = parse_sse(raw)
    assert events[-1] == "[DONE]"
    finishes = [e for e in events[:-1] if e["choices"] and e["choices"][0]["finish_reason"]]
    assert len(finishes) == 1 and finishes[0] is events[-2]
    texts = chunk_texts(events[:-2], False)
    assert "".join(x or "" for x in texts) + (chunk_texts([events[-2]], False)[0] or "") \
        == gen_text("slow", n)
    if busy:
        assert len(texts[0] or "") == 1  # the first token is never held
        assert max(len(x or "") for x in texts) >= 4  # ~5 tokens per 50 ms chunk
        assert len(texts) <= n // 4
        assert timer.holds >= len(texts) - 2 and timer.statistics() == 0
    else:
        assert [len(x or "") for x in texts] == [1] * n


def test_thread_demand_counts_this_threads_run_time() -> None:
    """The default busy clock: run (+ runnable wait) time of the calling thread, monotonic, and it
    advances by at least the CPU the thread burns."""
    a = thread_demand_s()
    c0 = time.thread_time()
    x = 0
    while time.thread_time() - c0 < 0.02:
        x += 1
    b = thread_demand_s()
    assert b - a >= 0.015
    t = threading.Thread(target=lambda: time.sleep(0.05))
    t.start()
    t.join()  # another thread sleeping does not count for this one
    assert thread_demand_s() - b < 0.04


async def test_disconnect_while_a_chunk_is_held_cancels_at_once(
    harness_factory: Any, autojump_clock: Any
) -> None:
    """A stream holding its next chunk (grouping engaged, a long interval) is asleep, not at a
    yield: a client that goes away then still cancels its request at once, and nothing is left."""
    import msgspec
    import trio

    from .test_stream import _disconnect

    cfg = make_config(server={"stream_busy_interval_ms": 5000})
    async with harness_factory(cfg, token_delay=0.01) as h:
        t = FakeTimes()
        timer = get_state(h.app).holds
        get_state(h.app)._pacer = StreamPacer(0.0, 5.0, 0.9, window_s=1e-9,
                                              clock=lambda: t.wall, cpu=lambda: t.cpu, timer=timer)

        def busy_clock() -> float:
            t.run(0.1, 1.0)
            return t.wall

        get_state(h.app)._pacer._clock = busy_clock  # type: ignore[assignment]
        conn = h.client.request(path=C, method="POST", headers={"content-type": "application/json"})
        async with conn as c:
            await c.send(msgspec.json.encode({"prompt": "x", "max_tokens": 400, "stream": True}))
            await c.send_complete()
            got = b""
            while b"text" not in got:
                got += await c.receive()
            await trio.sleep(0.5)  # the first chunk went out; the stream now holds for 5 s
            assert len(h.engine.active) == 1
            rid = next(iter(h.engine.active))
            t0 = trio.current_time()
            await _disconnect(c)
        await trio.sleep(0.01)
        assert rid in h.engine.cancelled_ids and h.engine.active == {}
        assert trio.current_time() - t0 < 0.5  # not when the hold ends
        assert timer.holds >= 1  # it was held by the app's timer, and that hold was cancelled
        text = await (await h.client.get("/metrics")).get_data(as_text=True)
        assert "calserve_streams_active 0.0" in text


@pytest.mark.parametrize("ms", [None, 0, 5])
async def test_the_app_timer_takes_the_hold_coalescing_margin(
    harness_factory: Any, autojump_clock: Any, ms: int | None
) -> None:
    """``server.stream_hold_coalesce_ms`` (default 2) is the app's hold timer's margin once it
    serves (0: the timer installs no instrument; pacing.HoldTimer)."""
    cfg = make_config(server={} if ms is None else {"stream_hold_coalesce_ms": ms})
    async with harness_factory(cfg, token_delay=0.01, coalesce=True) as h:
        timer = get_state(h.app).holds
        assert timer.running
        assert timer.coalesce_s == pytest.approx((2 if ms is None else ms) / 1000)
