"""calserve.api.write_watch: a streamed response's connection is closed when one of its writes
has not completed within the send timeout, or CUT_CLOSE_S after the engine gave up on its client;
never while writes complete. Fake clock (trio-native only)."""

from __future__ import annotations

from typing import Any

import trio
import trio.testing

from calserve.api.write_watch import CUT_CLOSE_S, WriteWatch, close_later


async def _blocked(message: dict[str, Any]) -> None:
    await trio.sleep_forever()  # a client that does not read: the write never completes


async def _quick(message: dict[str, Any]) -> None:
    await trio.sleep(0.01)


async def test_a_write_stuck_past_the_timeout_closes(autojump_clock: trio.testing.MockClock
                                                     ) -> None:
    closed: list[float] = []
    watch = WriteWatch(lambda: closed.append(trio.current_time()), timeout_s=5.0)
    t0 = trio.current_time()
    async with trio.open_nursery() as n:
        n.start_soon(watch.run, None)
        send = watch.wrap(_quick)
        for _ in range(100):  # 1 s of writes that complete: nothing happens
            await send({})
        assert not closed
        with trio.move_on_after(60):
            await watch.wrap(_blocked)({})
        n.cancel_scope.cancel()
    assert len(closed) == 1 and abs(closed[0] - t0 - (1.0 + 5.0)) < 1e-6


async def test_given_up_closes_after_cut_close_s(autojump_clock: trio.testing.MockClock) -> None:
    closed: list[float] = []
    gave_up = trio.Event()
    watch = WriteWatch(lambda: closed.append(trio.current_time()), timeout_s=30.0)
    async with trio.open_nursery() as n:
        n.start_soon(watch.run, gave_up.wait)
        send = watch.wrap(_quick)
        await send({})
        t = trio.current_time()
        gave_up.set()
        await send({})  # writes that still complete do not put the close off
        await trio.sleep(10)
        n.cancel_scope.cancel()
    assert len(closed) == 1 and abs(closed[0] - (t + CUT_CLOSE_S)) < 1e-6


async def test_cancelled_with_the_handler_closes_nothing(autojump_clock: trio.testing.MockClock
                                                         ) -> None:
    closed: list[int] = []
    watch = WriteWatch(lambda: closed.append(1), timeout_s=1.0)
    async with trio.open_nursery() as n:
        n.start_soon(watch.run, trio.sleep_forever)
        await watch.wrap(_quick)({})
        n.cancel_scope.cancel()  # the response ended
    await trio.sleep(5)
    assert not closed
    # close_later survives the cancel of the scope it was started in (shielded from its start).
    with trio.CancelScope() as scope:
        scope.cancel()
        async with trio.open_nursery() as n:
            n.start_soon(close_later, lambda: closed.append(2))
    assert closed == [2]
