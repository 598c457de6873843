"""HoldTimer (calserve/api/pacing.py): the streams' holds woken from one task. A hold returns at its
time (never before, never later than the timer's wake-up for it), a cancelled hold raises at once
and leaves nothing behind, and without a running timer a hold is ``trio.sleep_until``."""

from __future__ import annotations

import math
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from calserve.api.pacing import IDLE_MIN_S, HoldTimer, StreamPacer, WakeCoalescer


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


# ------------------------------------------------------------------ riding the loop's wake-ups
async def test_release_soon_wakes_the_holds_due_within_the_margin_early(autojump_clock: Any) -> None:
    """What the loop's wake-up from idle calls: every hold due within ``coalesce_s`` wakes now (a
    cancelled one is skipped), the later ones at their own time, and the timer's own wake-up moves
    to the earliest hold left."""
    timer = HoldTimer(coalesce_s=0.002)
    woke: dict[str, float] = {}
    async with trio.open_nursery() as outer:
        await outer.start(timer.run)
        t0 = trio.current_time()

        async def one(name: str, hold: float, cancel_at: float | None = None) -> None:
            with trio.CancelScope(deadline=t0 + cancel_at if cancel_at is not None else math.inf):
                await timer.hold_until(t0 + hold)
                woke[name] = trio.current_time() - t0

        async with trio.open_nursery() as n:
            n.start_soon(one, "a", 1.0)
            n.start_soon(one, "b", 1.0015)
            n.start_soon(one, "gone", 1.001, 0.5)  # cancelled before: its entry is skipped
            n.start_soon(one, "c", 1.003)
            n.start_soon(one, "d", 5.0)
            await trio.sleep_until(t0 + 0.9995)
            timer.release_soon()
            assert timer.coalesced == 2
        outer.cancel_scope.cancel()
    assert woke == {"a": 0.9995, "b": 0.9995, "c": 1.003, "d": 5.0}
    assert timer.coalesced == 2 and timer.statistics() == 0


async def test_release_soon_with_nothing_due_soon_changes_nothing(autojump_clock: Any) -> None:
    timer = HoldTimer(coalesce_s=0.002)
    async with trio.open_nursery() as outer:
        await outer.start(timer.run)
        timer.release_soon()  # nothing held
        out_box: dict[int, tuple[str, float]] = {}

        async def holds() -> None:
            out_box.update(await _holds(timer, [(0.0, 0.01, None)]))

        outer.start_soon(holds)
        await trio.sleep(0.007)
        timer.release_soon()  # due in 3 ms: outside the margin
        await trio.sleep(0.01)
        assert out_box == {0: ("woke", 0.01)} and timer.coalesced == 0
        outer.cancel_scope.cancel()


def _run_with_idle_loop(coalesce_s: float) -> tuple[float, int]:
    """A held stream due 1 ms after another task wakes the loop (a device completion's wake), the
    loop idle in between: (when the stream woke, the timer's early releases). A MockClock whose autojump waits 1 ms of real time
    first: the loop really waits in epoll (an idle wait the instrument measures) before each jump."""
    seen: dict[str, Any] = {}

    async def main() -> None:
        timer = HoldTimer(coalesce_s=coalesce_s)
        async with trio.open_nursery() as outer:
            await outer.start(timer.run)
            t0 = trio.current_time()

            async def completion() -> None:  # wakes the loop at t0 + 1.0, then idles
                await trio.sleep_until(t0 + 1.0)

            async def stream() -> None:
                await timer.hold_until(t0 + 1.001)
                seen["woke"] = trio.current_time() - t0

            async with trio.open_nursery() as n:
                n.start_soon(completion)
                n.start_soon(stream)
            seen["coalesced"] = timer.coalesced
            outer.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0.001))
    return seen["woke"], seen["coalesced"]


def test_a_hold_due_just_after_an_idle_wake_goes_out_with_it() -> None:
    """Through the trio instrument: the loop idles until another task's time (t0 + 1.0), wakes
    for it, idles again; the hold due at t0 + 1.001 goes out at that wake with a 2 ms margin, at
    its own time with the coalescing off."""
    woke, coalesced = _run_with_idle_loop(0.002)
    assert woke == pytest.approx(1.0, abs=1e-9) and coalesced == 1
    woke, coalesced = _run_with_idle_loop(0.0)
    assert woke == pytest.approx(1.001, abs=1e-9) and coalesced == 0


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_only_an_idle_wait_releases_holds_early() -> None:
    """The instrument releases only after an IO wait the loop entered with nothing to run
    (timeout > 0) and that lasted IDLE_MIN_S or more; a loop with work (timeout 0: saturated)
    or a wait that found IO ready at once leaves the holds to their own time."""
    calls: list[float] = []
    clock = _Clock()
    c = WakeCoalescer(lambda: calls.append(clock.t), clock)
    c.before_io_wait(0.0)  # runnable tasks: the loop does not sleep
    clock.t += 1.0
    c.after_io_wait(0.0)
    c.before_io_wait(0.01)  # nothing to run, but IO was ready at once
    clock.t += IDLE_MIN_S / 2
    c.after_io_wait(0.01)
    assert calls == []
    c.before_io_wait(0.01)  # an idle wait
    clock.t += 2 * IDLE_MIN_S
    c.after_io_wait(0.01)
    assert calls == [clock.t]
    c.before_io_wait(0.0)
    c.after_io_wait(0.0)
    assert len(calls) == 1


def test_a_negative_margin_is_refused() -> None:
    with pytest.raises(ValueError, match="coalesce_s"):
        HoldTimer(coalesce_s=-0.001)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=60)
@given(st.lists(st.tuples(st.floats(0.0, 0.05), st.floats(0.0, 0.05)), min_size=1, max_size=30),
       st.lists(st.floats(0.0, 0.1), max_size=15), st.floats(0.0, 0.01))
def test_holds_ride_wake_ups_never_late_and_at_most_the_margin_early(
        plan: list[tuple[float, float]], pokes: list[float], margin: float) -> None:
    """Holders (start, hold) and wake-ups of the loop at ``pokes`` (``release_soon``): each hold
    wakes at the first wake-up that finds it due within ``margin``, else at its own time — never
    after its time, never more than ``margin`` before it."""
    until = [s + h for s, h in plan]
    # no ties between a wake-up and a hold's start or its edge (one tick, trio's order decides)
    for p in pokes:
        for (s, _), u in zip(plan, until, strict=True):
            assume(abs(p - s) > 1e-7 and abs(p + margin - u) > 1e-7)

    async def main() -> dict[int, float]:
        timer = HoldTimer(coalesce_s=margin)
        out: dict[int, float] = {}
        async with trio.open_nursery() as outer:
            await outer.start(timer.run)
            t0 = trio.current_time()

            async def one(i: int, start: float, hold: float) -> None:
                await trio.sleep_until(t0 + start)
                await timer.hold_until(t0 + start + hold)
                out[i] = trio.current_time() - t0

            async def poke(at: float) -> None:
                await trio.sleep_until(t0 + at)
                timer.release_soon()

            async with trio.open_nursery() as n:
                for i, (start, hold) in enumerate(plan):
                    n.start_soon(one, i, start, hold)
                for at in pokes:
                    n.start_soon(poke, at)
            assert timer.statistics() == 0
            outer.cancel_scope.cancel()
        return out

    got = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    for i, ((start, hold), u) in enumerate(zip(plan, until, strict=True)):
        riders = [p for p in sorted(pokes) if start < p < u and u <= p + margin]
        want = riders[0] if riders and hold > 0 else u
        assert got[i] == pytest.approx(want, abs=1e-9), (i, start, hold, pokes, margin)
        assert u - margin - 1e-9 <= got[i] <= u + 1e-9
