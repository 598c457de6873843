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


class _ParkedHandle:
    """A stream's handle as the watcher sees it: parked while ``parked``; what it was told. Its
    ``park`` and ``give_up`` call the watcher back as the engine's stream does."""

    def __init__(self) -> None:
        self.parked = False
        self.watched = False
        self.reports: list[tuple[float, int, float | None]] = []
        self._on_parked: Any = None
        self._on_given_up: Any = None

    def watch(self, on_parked: Any = None, on_given_up: Any = None) -> None:
        self.watched = True
        self._on_parked, self._on_given_up = on_parked, on_given_up

    def park(self) -> None:
        self.parked = True
        if self._on_parked is not None:
            self._on_parked()

    def give_up(self) -> None:
        if self._on_given_up is not None:
            self._on_given_up()

    def report_unread(self, n: int, stalled: float | None) -> None:
        self.reports.append((trio.current_time(), n, stalled))


async def test_a_write_stuck_past_the_timeout_closes(autojump_clock: trio.testing.MockClock
                                                     ) -> None:
    closed: list[float] = []
    watch = WriteWatch(lambda: closed.append(trio.current_time()), timeout_s=5.0)
    t0 = trio.current_time()
    async with trio.open_nursery() as n:
        n.start_soon(watch.run)
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
    h = _ParkedHandle()
    watch = WriteWatch(lambda: closed.append(trio.current_time()), timeout_s=30.0)
    async with trio.open_nursery() as n:
        n.start_soon(watch.run)
        watch.follow(h, lambda: (0, None), n)
        send = watch.wrap(_quick)
        await send({})
        t = trio.current_time()
        h.give_up()  # the engine's callback, from its own code
        await send({})  # writes that still complete do not put the close off
        await trio.sleep(10)
        n.cancel_scope.cancel()
    assert len(closed) == 1 and abs(closed[0] - (t + CUT_CLOSE_S)) < 1e-6


async def test_cancelled_with_the_handler_closes_nothing(autojump_clock: trio.testing.MockClock
                                                         ) -> None:
    closed: list[int] = []
    watch = WriteWatch(lambda: closed.append(1), timeout_s=1.0)
    async with trio.open_nursery() as n:
        n.start_soon(watch.run)
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


async def test_a_parked_stream_is_polled_and_nudged_never_during_a_write(
        autojump_clock: trio.testing.MockClock) -> None:
    """While parked: the socket's figure is reported at POLL_S, doubling up to POLL_MAX_S, and an
    SSE comment is written after each look unless a write is under way; the stream's own write
    waits for a comment being written (one write at a time)."""
    from calserve.api.write_watch import NUDGE_BODY, POLL_MAX_S, POLL_S

    sent: list[tuple[float, bytes]] = []
    busy = [0]

    async def send(message: dict[str, Any]) -> None:
        busy[0] += 1
        assert busy[0] == 1, "two writes at once"
        sent.append((trio.current_time(), message.get("body", b"")))
        await trio.sleep(0.002 if message.get("body") == NUDGE_BODY else 0.3)
        busy[0] -= 1

    h = _ParkedHandle()
    watch = WriteWatch(lambda: None, timeout_s=30.0)
    out = watch.wrap(send)
    async with trio.open_nursery() as n:
        watch.follow(h, lambda: (123, 0.05), n)
        await trio.sleep(1.0)
        assert h.watched and not h.reports  # not parked: nothing looked at
        t0 = trio.current_time()
        h.park()
        await trio.sleep(0.5)
        h.parked = False
        times = [t - t0 for t, _, _ in h.reports]
        expect, t, poll = [], 0.0, POLL_S
        while t + poll <= 0.5 + 1e-9:
            t += poll
            expect.append(t)
            poll = min(2 * poll, POLL_MAX_S)
        assert [round(x, 6) for x in times] == [round(x, 6) for x in expect]
        assert all(r[1:] == (123, 0.05) for r in h.reports)
        nudges = [s for s in sent if s[1] == NUDGE_BODY]
        assert len(nudges) == len(expect)
        # A long write of the stream: no comment while it is under way.
        h.park()
        await out({"type": "http.response.body", "body": b"data: x\n\n", "more_body": True})
        await trio.sleep(0.05)
        h.parked = False
        await trio.sleep(0.2)
        n.cancel_scope.cancel()
    w_at = next(t for t, b in sent if b == b"data: x\n\n")
    assert not [t for t, b in sent if b == NUDGE_BODY and w_at < t < w_at + 0.3]


async def test_the_watch_runs_one_task_and_one_more_only_while_parked(
        autojump_clock: trio.testing.MockClock) -> None:
    """A streamed response's watch costs one task of the handler's (its write timer), whatever
    its streams; a stream's poll task exists only while it is parked, and a second park while
    one polls starts no second one."""
    from calserve.api.write_watch import POLL_MAX_S, watched_send

    class _Probe:
        def __init__(self) -> None:
            self.closed = 0

        def close(self) -> None:
            self.closed += 1

        def sample(self, now: float) -> tuple[int, float | None]:
            return 0, None

    hs = [_ParkedHandle(), _ParkedHandle()]
    probe = _Probe()
    async with trio.open_nursery() as n:
        out = watched_send(probe, _quick, hs, n, 30.0)  # type: ignore[arg-type]
        await out({"type": "http.response.body", "body": b"x", "more_body": True})
        assert all(h.watched for h in hs) and len(n.child_tasks) == 1
        hs[0].park()
        hs[0].park()
        await trio.sleep(0)
        assert len(n.child_tasks) == 2
        hs[0].parked = False  # resumed: its poll task ends at its next look
        await trio.sleep(2 * POLL_MAX_S)
        assert len(n.child_tasks) == 1
        looks = len(hs[0].reports)
        hs[1].park()
        await trio.sleep(0)
        assert len(n.child_tasks) == 2 and hs[1].reports == []
        await trio.sleep(0.05)
        assert hs[1].reports and len(hs[0].reports) == looks
        hs[1].parked = False
        await trio.sleep(2 * POLL_MAX_S)
        assert len(n.child_tasks) == 1 and probe.closed == 0
        n.cancel_scope.cancel()
    assert probe.closed == 0
