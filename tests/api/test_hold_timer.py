"""HoldTimer (calserve/api/pacing.py): the streams' holds woken from one task. A hold returns at its
time (never before, never later than the timer's wake-up for it), a cancelled hold raises at once
and leaves nothing behind, and without a running timer a hold is ``trio.sleep_until``."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from calserve.api.pacing import HoldTimer, StreamPacer


async def _holds(timer: HoldTimer, plan: list[tuple[float, float, float | None]]
                 ) -> dict[int, tuple[str, float]]:
    """Run ``(start, hold, cancel_after)`` holders at once; each one's outcome and end time."""
    out: dict[int, tuple[str, float]] = {}

    async def one(i: int, start: float, hold: float, cancel_after: float | None) -> None:
        await trio.sleep(start)
        t0 = trio.current_time()
        with trio.CancelScope(deadline=t0 + cancel_after if cancel_after is not None else
                              float("inf")) as scope:
            await timer.hold_until(t0 + hold)
            out[i] = ("woke", trio.current_time() - t0)
        if scope.cancelled_caught:
            out[i] = ("cancelled", trio.current_time() - t0)

    async with trio.open_nursery() as n:
        for i, (start, hold, cancel_after) in enumerate(plan):
            n.start_soon(one, i, start, hold, cancel_after)
    return out


async def test_holds_wake_at_their_time_in_order(autojump_clock: Any) -> None:
    timer = HoldTimer()
    order: list[int] = []
    async with trio.open_nursery() as outer:
        await outer.start(timer.run)
        assert timer.running
        t0 = trio.current_time()

        async def one(i: int, hold: float) -> None:
            await timer.hold_until(t0 + hold)
            assert trio.current_time() == t0 + hold
            order.append(i)

        async with trio.open_nursery() as n:
            for i, hold in enumerate([0.05, 0.01, 0.03, 0.01, 0.02]):
                n.start_soon(one, i, hold)
        # by time (trio runs the tasks woken in one tick in an order of its choosing)
        assert {*order[:2]} == {1, 3} and order[2:] == [4, 2, 0]
        assert timer.holds == 5 and timer.statistics() == 0
        outer.cancel_scope.cancel()
    assert not timer.running


async def test_an_earlier_hold_shortens_the_timers_sleep(autojump_clock: Any) -> None:
    """The timer sleeps until the earliest hold: one taken after a later one wakes at its own time."""
    timer = HoldTimer()
    async with trio.open_nursery() as outer:
        await outer.start(timer.run)
        out = await _holds(timer, [(0.0, 10.0, None), (0.001, 0.002, None)])
        assert out == {0: ("woke", 10.0), 1: ("woke", 0.002)}
        outer.cancel_scope.cancel()


async def test_a_cancelled_hold_raises_at_once_and_the_others_still_wake(autojump_clock: Any) -> None:
    timer = HoldTimer()
    async with trio.open_nursery() as outer:
        await outer.start(timer.run)
        out = await _holds(timer, [(0.0, 5.0, 0.5), (0.0, 1.0, None), (0.0, 6.0, None)])
        assert out == {0: ("cancelled", 0.5), 1: ("woke", 1.0), 2: ("woke", 6.0)}
        assert timer.statistics() == 0  # the cancelled entry was dropped when it came due
        outer.cancel_scope.cancel()


async def test_a_passed_time_returns_at_once_with_a_checkpoint(autojump_clock: Any) -> None:
    timer = HoldTimer()
    async with trio.open_nursery() as outer:
        await outer.start(timer.run)
        t0 = trio.current_time()
        await timer.hold_until(t0 - 1.0)
        assert trio.current_time() == t0 and timer.holds == 0
        with trio.CancelScope() as scope:  # a checkpoint: an outer cancel is seen there
            scope.cancel()
            await timer.hold_until(t0)
            pytest.fail("not reached")  # pragma: no cover
        assert scope.cancelled_caught
        outer.cancel_scope.cancel()


async def test_without_a_running_timer_a_hold_is_a_sleep(autojump_clock: Any) -> None:
    timer = HoldTimer()
    t0 = trio.current_time()
    await timer.hold_until(t0 + 0.25)
    assert trio.current_time() == t0 + 0.25 and timer.holds == 0
    # a pacer built without a timer has its own (not started: the same fallback)
    assert not StreamPacer().timer.running


async def test_stopping_the_timer_releases_every_hold_at_once(autojump_clock: Any) -> None:
    timer = HoldTimer()
    woke: list[float] = []
    stop = trio.CancelScope()

    async def run_timer(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with stop:
            await timer.run(task_status=task_status)

    async with trio.open_nursery() as n:
        await n.start(run_timer)
        t0 = trio.current_time()

        async def one() -> None:
            await timer.hold_until(t0 + 100.0)
            woke.append(trio.current_time() - t0)

        for _ in range(3):
            n.start_soon(one)
        await trio.sleep(1.0)
        stop.cancel()  # the app stops its timer: the held streams read at once
    assert woke == [1.0, 1.0, 1.0]
    assert not timer.running and timer.statistics() == 0
    # a hold after the timer stopped falls back to a sleep
    t1 = trio.current_time()
    await timer.hold_until(t1 + 0.5)
    assert trio.current_time() == t1 + 0.5


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=60)
@given(st.lists(st.tuples(st.floats(0.0, 0.05), st.floats(0.0, 0.05),
                          st.one_of(st.none(), st.floats(0.0, 0.06))),
                min_size=1, max_size=40))
def test_many_holds_and_cancels_behave_as_sleeps(plan: list[tuple[float, float, float | None]]
                                                 ) -> None:
    """The same plan of holders (start, hold, cancel after) ends the same way through the timer as
    through ``trio.sleep_until``: each wakes at its time or is cancelled at its cancel time,
    whichever is first (a tie: both fire in the same tick, and the outcome is the sleep's), and
    the timer is left with nothing held."""

    async def through(use_timer: bool) -> dict[int, tuple[str, float]]:
        timer = HoldTimer()
        async with trio.open_nursery() as outer:
            if use_timer:
                await outer.start(timer.run)
            out = await _holds(timer, plan)
            # a cancelled hold's entry stays until its time, then goes
            await trio.sleep(0.2)
            assert timer.statistics() == 0
            outer.cancel_scope.cancel()
        return out

    def run(use_timer: bool) -> dict[int, tuple[str, float]]:
        return trio.run(through, use_timer, clock=trio.testing.MockClock(autojump_threshold=0))

    got, want = run(True), run(False)
    assert got.keys() == want.keys() == set(range(len(plan)))
    for i, (_, hold, cancel_after) in enumerate(plan):
        kind, dt = got[i]
        assert kind == want[i][0] and dt == pytest.approx(want[i][1], abs=1e-9)
        if cancel_after is None or hold < cancel_after - 1e-6:
            assert kind == "woke" and dt == pytest.approx(hold, abs=1e-9)
        elif cancel_after < hold - 1e-6:
            assert kind == "cancelled" and dt == pytest.approx(cancel_after, abs=1e-9)
